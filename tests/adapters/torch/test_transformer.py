"""The zoo's transformer LM and its token data."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch.transformer import TransformerLM  # noqa: E402
from polytrain.data import load_dataset, token_corpus  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec.tables import TokenSpec  # noqa: E402
from polytrain.spec.zoo import TransformerParams  # noqa: E402


def lm(**params) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(vocab=16, seq_len=8, params=TransformerParams(d_model=16, n_heads=4, n_layers=2, **params))


def test_logits_per_position_and_causal() -> None:
    model = lm().eval()
    tokens = torch.randint(0, 16, (3, 8))
    out = model(tokens)
    assert out.shape == (3, 8, 16)
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 16
    out2 = model(changed)
    torch.testing.assert_close(out2[:, :5], out[:, :5])  # the future does not leak backwards
    assert not torch.allclose(out2[:, 5:], out[:, 5:])


def test_tied_head_is_the_embedding() -> None:
    tied, untied = lm(), lm(tie_weights=False)
    assert tied.head.weight is tied.tok_emb.weight
    state = tied.state_dict()
    assert {"tok_emb.weight", "head.weight"} <= set(state)
    assert sum(p.numel() for p in tied.parameters()) + 16 * 16 == sum(p.numel() for p in untied.parameters())
    assert untied.head.weight is not untied.tok_emb.weight


def test_too_long_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the model's 8"):
        lm()(torch.zeros(1, 9, dtype=torch.long))


def test_heads_must_divide_width() -> None:
    with pytest.raises(SpecError, match="model.params.n_heads: 3 does not divide d_model 16"):
        validation.from_dict({"model": {"name": "transformer", "params": {"d_model": 16, "n_heads": 3}},
                              "data": {"name": "tokens"}})


def test_transformer_and_token_data_go_together() -> None:
    with pytest.raises(SpecError, match="model.name: 'transformer' needs data.name 'tokens'"):
        validation.from_dict({"model": {"name": "transformer"}})
    with pytest.raises(SpecError, match="data.name: 'tokens' needs model.name 'transformer'"):
        validation.from_dict({"data": {"name": "tokens"}})


def test_corpus_is_deterministic_and_follows_its_rule() -> None:
    spec = TokenSpec(samples=400, seq_len=24, vocab=12, noise=0.2, seed=3)
    seq = token_corpus(spec)
    assert seq.shape == (400, 25) and seq.min() >= 0 and seq.max() < 12
    np.testing.assert_array_equal(seq, token_corpus(spec))
    assert not np.array_equal(seq, token_corpus(TokenSpec(samples=400, seq_len=24, vocab=12, noise=0.2, seed=4)))
    # the most frequent successor of each pair is the rule's; it is followed ~ (1 - noise) + noise / vocab
    pairs = {}
    for row in seq:
        for a, b, c in zip(row, row[1:], row[2:]):
            pairs.setdefault((a, b), []).append(c)
    hits = sum(np.bincount(v).max() for v in pairs.values())
    total = sum(len(v) for v in pairs.values())
    assert 0.78 < hits / total < 0.9


def test_token_dataset_is_next_token_prediction() -> None:
    spec = validation.from_dict({"model": {"name": "transformer"},
                                 "data": {"name": "tokens", "tokens": {"samples": 100, "seq_len": 10, "vocab": 7}}})
    data = load_dataset(spec.data, seed=0)
    assert data.info.task == "next_token" and data.info.num_outputs == 7 and data.info.input_shape == (10,)
    assert len(data.x_train) + len(data.x_val) == 100 and len(data.x_val) == 20
    np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])  # y is x shifted by one token
    assert data.x_train.dtype == np.int64
