"""`polytrain plan` in one process: the census against the real model, the formulas on hand-made parameter lists,
the recommendation as device memory shrinks, ZeRO rows against DeepSpeed's own estimator, and the command's
output and bad input. What a real multi-rank run holds and sends: tests/multiproc/test_plan_measure.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from polytrain import cli, validation  # noqa: E402
from polytrain.plan import candidates as cand  # noqa: E402
from polytrain.plan import memory  # noqa: E402
from polytrain.plan.census import Param, take_census  # noqa: E402
from polytrain.plan.command import plan, predict, table  # noqa: E402
from polytrain.plan.comms import Link, parse_link, wire_factor  # noqa: E402
from polytrain.plan.memory import (  # noqa: E402
    Layout,
    Precision,
    fsdp_shard,
    model_states,
    zero3_partition,
    zero_paper_bytes,
    zero_partition,
    zero_straddling_grads,
)

LM = {"model": {"name": "transformer", "params": {"d_model": 64, "n_heads": 4, "n_layers": 4, "tie_weights": False}},
      "data": {"name": "tokens", "batch_size": 4, "tokens": {"vocab": 128, "seq_len": 16, "samples": 64}},
      "optimizer": {"name": "adam", "lr": 1e-3}}
GiB = 2**30


@pytest.fixture(scope="module")
def lm_spec():  # noqa: ANN201
    return validation.from_dict(LM)


@pytest.fixture(scope="module")
def lm_census(lm_spec):  # noqa: ANN001, ANN201
    return take_census(lm_spec, 4)


@pytest.fixture(scope="module")
def lm_plan(lm_spec, lm_census):  # noqa: ANN001, ANN201
    return plan(lm_spec, 4, 1, 80 * GiB, Link(), lm_census)


def _params(*shapes: tuple[int, ...]) -> list[Param]:
    return [Param(f"m{i}.weight", shape, 4, None) for i, shape in enumerate(shapes)]


def test_partitions_pad_as_the_libraries_do() -> None:
    params = _params((5, 3), (4,))
    assert fsdp_shard(params, 2) == 3 * 3 + 2  # FSDP2: dim 0 padded to a multiple of the group, per parameter
    assert zero3_partition(params, 2) == 8 + 2  # ZeRO-3: each parameter cut on its own
    assert zero_partition(_params((10,), (6,)), 2) == 8  # ZeRO-1/2: the flat vector cut in equal parts
    # rank 1's partition [8, 16) reaches into both parameters: DeepSpeed keeps both whole gradients (fp32)
    assert zero_straddling_grads(_params((10,), (6,)), 2) == 16


def test_zero_paper_formula() -> None:
    assert [zero_paper_bytes(stage, 4) for stage in range(4)] == [16, 4 + 4 + 2, 4 + 3, 4]


def test_model_states_by_optimizer_and_precision() -> None:
    params = _params((64, 64), (64,))
    n = 64 * 64 + 64
    adam, sgd, plain = (Precision("fp32", s) for s in (8, 4, 0))
    ddp = Layout("ddp", data=4)
    assert model_states(ddp, params, adam, 4).model_states == 16 * n
    assert model_states(ddp, params, sgd, 4).optimizer == 4 * n
    assert model_states(ddp, params, plain, 4).optimizer == 0
    assert model_states(ddp, params, adam, 4).temporary["ddp gradient buckets"] == 4 * n
    fsdp = model_states(Layout("fsdp", sharding="full_shard", data=4), params, adam, 4)
    assert fsdp.model_states == 16 * (16 * 64 + 16)
    bf16 = model_states(Layout("deepspeed", stage=3, data=4), params, Precision("bf16", 8), 4,
                        {"persistence_threshold": 0})
    assert (bf16.params, bf16.grads, bf16.master, bf16.optimizer) == (2 * n / 4, 2 * n / 4, 4 * n / 4, 8 * n / 4)
    assert bf16.temporary[memory.FP32_GRADS] == 4 * n / 4  # made from the bf16 partition for the optimizer step


@pytest.mark.slow
def test_census_counts_the_real_model_and_its_saved_tensors(lm_spec, lm_census) -> None:  # noqa: ANN001
    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.plan.census import model_info
    from polytrain.spec.zoo import model_params

    census = lm_census
    info = model_info(lm_spec)
    model = build_transformer(model_params("transformer", lm_spec.model.params), info)
    assert census.numel == sum(p.numel() for p in model.parameters())
    assert census.n_blocks == 4 and census.tensor_degrees == (1, 2, 4)
    assert census.block_sizes() == [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    # tensor rank 0 of T=2 holds half of each split matrix, whole LayerNorms and position embedding
    whole = {p.name: p.numel for p in census.params}
    local = {p.name: p.numel for p in census.local_params[2]}
    assert local["blocks.0.mlp.fc.weight"] * 2 == whole["blocks.0.mlp.fc.weight"]
    assert local["blocks.0.ln1.weight"] == whole["blocks.0.ln1.weight"]
    # one real forward at 3 samples keeps what the fake traces at 1 and 2 samples predict, byte for byte
    x, y = torch.randint(0, 128, (3, 16)), torch.randint(0, 128, (3, 16))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):  # noqa: ANN001, ANN202
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").sum()
    assert sum(saved.values()) == census.traces[1].total().at(3)


@pytest.mark.slow
def test_a_model_that_fits_gets_ddp(lm_plan) -> None:  # noqa: ANN001
    assert lm_plan["recommended"]["layout"] == "ddp"
    assert lm_plan["recommended"]["set"] == ["backend=ddp"]
    assert all(row["fits"] for row in lm_plan["layouts"])


@pytest.mark.slow
def test_optimizer_state_that_does_not_fit_gets_sharding(lm_spec, lm_census, lm_plan) -> None:  # noqa: ANN001
    rows = {row["layout"]: row for row in lm_plan["layouts"]}
    limit = rows["ddp +ac"]["device_bytes"] - 1  # ddp fits neither with nor without checkpointing
    best = plan(lm_spec, 4, 1, limit, Link(), lm_census)["recommended"]
    assert best["layout"].split()[0] in ("zero1", "zero2", "fsdp")
    assert best["optimizer_state"] < rows["ddp"]["optimizer_state"]
    assert best["grid"] == [1, 4, 1] and best["host_bytes"] == 0


@pytest.mark.slow
def test_parameters_that_do_not_fit_sharded_get_model_parallel_or_offload(lm_spec, lm_census,  # noqa: ANN001
                                                                          lm_plan) -> None:  # noqa: ANN001
    # every data-parallel layout without offload (ddp, fsdp, ZeRO-1/2/3, checkpointing or not) too big
    flat = [row for row in lm_plan["layouts"] if row["grid"] == [1, 4, 1] and not row["host_bytes"]]
    limit = min(row["device_bytes"] for row in flat) - 1
    best = plan(lm_spec, 4, 1, limit, Link(), lm_census)["recommended"]
    assert best is not None and (best["grid"] != [1, 4, 1] or best["host_bytes"] > 0)
    doc = plan(lm_spec, 4, 1, 1024, Link(), lm_census)
    assert doc["recommended"] is None and not any(row["fits"] for row in doc["layouts"])
    assert doc["layouts"][0]["reason"].startswith("needs ")


@pytest.mark.slow
def test_host_memory_rules_out_offload_that_a_node_cannot_hold(lm_spec, lm_census, lm_plan) -> None:  # noqa: ANN001
    """With --host-memory, a row fits only where the node's ranks' offloaded states fit it too: 4 ranks on one
    node, each with ``host_bytes`` in host memory."""
    offloads = [row for row in lm_plan["layouts"] if row["host_bytes"] > 0]
    smallest = min(row["host_bytes"] for row in offloads)
    assert lm_plan["host_memory"] is None and all(row["fits"] for row in offloads)
    doc = plan(lm_spec, 4, 1, 80 * GiB, Link(), lm_census, host_memory=4 * smallest - 1)
    rows = {row["layout"]: row for row in doc["layouts"]}
    assert all(not rows[row["layout"]]["fits"] for row in offloads)
    assert all(rows[row["layout"]]["reason"].startswith("its host memory: 4 rank(s)") for row in offloads)
    assert all(row["fits"] for row in doc["layouts"] if row["host_bytes"] == 0)
    assert doc["layouts"][-1]["host_bytes"] > 0  # what does not fit comes last
    # on 2 nodes, 2 ranks share a node's memory: twice the smallest offload fits there
    two = plan(lm_spec, 4, 2, 80 * GiB, Link(), lm_census, host_memory=2 * smallest)
    assert all(row["fits"] == (row["host_bytes"] <= smallest) for row in two["layouts"])
    assert "per node for offloaded states" in table(doc) and "not checked" in table(lm_plan)


def test_a_tensorflow_spec_gets_its_data_parallel_rows() -> None:
    """Sized through the zoo model's PyTorch twin: every rank holds the whole fp32 model, its gradients and
    all-reduces them once per step, on each TensorFlow backend (no sharded or model-parallel rows)."""
    spec = validation.from_dict({"framework": "tensorflow", "model": {"name": "mlp", "params": {"hidden_sizes": [32]}}})
    doc = plan(spec, 2, 1, 80 * GiB, Link())
    weights = 4 * (64 * 32 + 32 + 32 * 10 + 10)  # digits: 64 features, 10 classes
    assert [row["layout"] for row in doc["layouts"]] == list(cand.TF_BACKENDS)
    for row in doc["layouts"]:
        assert (row["parameters"], row["gradients"], row["comm_payload"]) == (weights, weights, {"allreduce": weights})
        assert row["set"] == [f"backend={row['layout']}"] and row["grid"] == [1, 2, 1]
    assert doc["recommended"]["layout"] == "mpi"


@pytest.mark.slow
def test_recommended_overrides_run_the_layout(lm_spec, lm_plan) -> None:  # noqa: ANN001
    from polytrain.spec.files import apply_overrides

    for row in lm_plan["layouts"]:
        spec = validation.from_dict(apply_overrides(lm_spec.to_dict(), row["set"]))
        assert cand.spec_layout(spec, 4).name == row["layout"]
        # the same samples per step as the spec's data parallel run on 4 ranks: 4 per rank, 16 in all
        data = row["grid"][1]
        assert (spec.data.global_batch_size or spec.data.batch_size * data) == 16
        assert row["micro_batch"] * row["grid"][0] == 16 / data  # a pipeline cuts it into P micro-batches


def test_a_user_factory_and_tensor_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "multiproc"))
    spec = validation.from_dict({"model": {"name": "tp_user_model:make", "params": {"width": 32, "depth": 4}},
                                 "backend": "ddp", "parallel": {"tensor": 2, "tensor_plan": "tp_user_model:plan"}})
    doc = plan(spec, 4, 1, 80 * GiB, Link())
    rows = {row["layout"]: row for row in doc["layouts"]}
    assert doc["recommended"]["set"] == ["parallel.tensor=1", "parallel.tensor_plan=null"]
    split, whole = rows["ddp T2×P1×D2"], rows["ddp"]
    assert whole["parameters"] / 2 < split["parameters"] < whole["parameters"]  # up/down split, inp/out whole
    assert split["comm_payload"]["allreduce"] > rows["ddp T1×P2×D2"]["comm_payload"]["allreduce"]
    assert rows["ddp T1×P4×D1"]["comm_payload"]["p2p"] > 0


def deepspeed_estimator_view(pred: memory.Prediction) -> float:
    """The device bytes DeepSpeed's ``estimate_zero2/3_model_states_mem_needs`` counts for a bf16/fp16 row: model
    states, plus ZeRO-3's largest gathered module (its ``largest_layer_memory``), with the gradients counted as it
    counts them: the fp32 partition, and at ZeRO-1/2 a low-precision partition too (a rank holds those whole where
    they reach into its partition: ``pred.grads``)."""
    gathered = pred.temporary.get("gathered module (parameters + gradients)", 0.0)
    fp32 = pred.temporary.get(memory.FP32_GRADS, 0.0)
    grads = fp32 * (2 + 4) / 4 if (pred.layout.stage or 0) <= 2 else fp32
    return pred.params + pred.master + pred.optimizer + grads + gathered


@pytest.mark.parametrize("stage, offload", [(2, ""), (2, "optimizer"), (3, ""), (3, "optimizer"),
                                            (3, "optimizer+params")])
def test_zero_rows_agree_with_deepspeeds_estimator(stage: int, offload: str) -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.plan.census import model_info
    from polytrain.spec.zoo import model_params

    spec = validation.from_dict({**LM, "precision": "bf16", "backend": "deepspeed",
                                 "deepspeed": {"stage": stage, "config": {"zero_optimization": {
                                     "stage3_param_persistence_threshold": 0}} if stage == 3 else {}}})
    census = take_census(spec, 4, degrees=())
    model = build_transformer(model_params("transformer", spec.model.params), model_info(spec))
    total, largest = model_to_params(model)
    pred = predict(spec, census, Layout("deepspeed", stage=stage, offload=offload, data=4), 4)
    if stage == 2:
        _, expected = estimate_zero2_model_states_mem_needs(total, 4, 1, cpu_offload=bool(offload))
    else:
        _, expected, _ = estimate_zero3_model_states_mem_needs(total, largest, 4, 1, cpu_offload=bool(offload),
                                                               cpu_offload_params="params" in offload)
    assert deepspeed_estimator_view(pred) == pytest.approx(expected, rel=2e-3)


def test_link_model() -> None:
    assert parse_link("intra=200,inter=25").inter == 25e9
    assert parse_link("host=10").intra == Link().intra
    assert wire_factor("allreduce", 4) == 1.5 and wire_factor("allgather", 4) == 0.75 and wire_factor("p2p", 2) == 1


@pytest.mark.slow
def test_command_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    spec = tmp_path / "lm.json"
    spec.write_text(json.dumps(LM))
    assert cli.main(["plan", str(spec), "-np", "2", "--device-memory", "1GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["layout"] == "ddp" and doc["world_size"] == 2
    names = {r["layout"] for r in doc["layouts"]}
    assert {"ddp", "fsdp full_shard", "zero3", "ddp T2×P1×D1", "ddp T1×P2×D1"} <= names
    assert cli.main(["plan", str(spec), "-np", "2", "--link", "intra=50,inter=5"]) == 0
    out = capsys.readouterr().out
    assert "recommended: ddp  --set backend=ddp" in out


@pytest.mark.parametrize("argv, words", [
    (["-np", "2", "--device-memory", "80"], "--device-memory: expected a positive size with a unit"),
    (["-np", "2", "--host-memory", "lots"], "--host-memory: expected a positive size with a unit"),
    (["-np", "2", "--link", "intra=fast"], "--link: intra must be a positive number"),
    (["-np", "2", "--link", "wan=3"], "--link: expected intra=GB/s"),
    (["-np", "0"], "-np: expected a positive number of ranks"),
    (["-np", "4", "--nodes", "3"], "--nodes: 3 must be positive and divide -np 4"),
    # checked before a --probe run is started (its launcher here would fail first)
    (["-np", "4", "--nodes", "3", "--probe", "--launcher", "nope"], "--nodes: 3 must be positive and divide -np 4"),
    (["-np", "2", "--device-tflops", "0", "--probe", "--launcher", "nope"], "--device-tflops: expected a positive"),
    (["-np", "4", "--nodes", "1", "--probe", "-H", "h1:2,h2:2"], "--nodes: 1, but -H names 2 host(s)"),
    (["-np", "2", "--set", "model.name=nope"], "model.name: unknown model"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


@pytest.mark.slow
def test_nvme_rows_need_a_drive_and_put_only_large_tensors_there(lm_spec, lm_census) -> None:  # noqa: ANN001
    """ZeRO-Infinity (issue 35): weighed only given a drive's directory, ranked after host-memory offload, the
    recommended overrides name the directory; on the drive go the fp32 partition with Adam's moments and the
    gradients and partitions of parameters whose part reaches 1 MiB (DeepSpeed's rule; the LM here has none such
    parameter, so only the flat partition, and only once it reaches 1 MiB)."""
    assert not any("nvme" in row["layout"] for row in plan(lm_spec, 4, 1, 80 * GiB, Link(), lm_census)["layouts"])
    doc = plan(lm_spec, 4, 1, 80 * GiB, Link(), lm_census, nvme_path="/nvme")
    rows = {row["layout"]: row for row in doc["layouts"]}
    opt, both = rows["zero3 +offload(nvme-optimizer)"], rows["zero3 +offload(nvme-optimizer+params)"]
    assert opt["set"][-2:] == ["deepspeed.offload_optimizer=nvme", "deepspeed.nvme_path=/nvme"]
    assert "deepspeed.offload_param=nvme" in both["set"]
    part = zero3_partition(lm_census.params, 4)
    assert 4 * part < 2**20  # the LM's partition: under DeepSpeed's 1 MiB, kept in host memory
    assert (opt["drive_bytes"], both["drive_bytes"]) == (0.0, 0.0)
    assert opt["host_bytes"] == 4 * part + (4 + 8) * part  # gradients, master and moments
    assert both["host_bytes"] == opt["host_bytes"] + 4 * part + 4 * 5 * 10**8  # parameters and swap buffers
    assert both["comm_payload"].get("drive", 0.0) == 0.0
    assert both["device_bytes"] < opt["device_bytes"] and both["parameters"] == 0
    order = [pred.layout.name for pred in cand.rank([predict(lm_spec, lm_census, Layout(
        "deepspeed", stage=3, offload=o, data=4, nvme_path="/nvme"), 4) for o in ("nvme-optimizer", "optimizer")],
        80 * GiB)]
    assert order == ["zero3 +offload(optimizer)", "zero3 +offload(nvme-optimizer)"]
    # a 2048×2048 matrix is 4 MiB per rank of 4: it goes to the drive, with its gradient (and partition)
    params = _params((2048, 2048), (64,))
    adam = Precision("fp32", 8)
    big = model_states(Layout("deepspeed", stage=3, offload="nvme-optimizer+params", data=4), params, adam, 4)
    n = 2048 * 2048 // 4
    assert big.drive == (4 + 8) * (n + 16) + 4 * n + 4 * n
    # in host memory: the bias' gradient and partition, 4 pinned optimizer swap buffers of the partition's size,
    # and the parameter swapper's 5 × 1e8 fp32 elements (DeepSpeed's defaults)
    assert big.host == 4 * 16 + 4 * 4 * (n + 16) + 4 * (n + 16) + 4 * 5 * 10**8  # max_in_cpu keeps them all
    streamed = model_states(Layout("deepspeed", stage=3, offload="nvme-optimizer+params", data=4), params, adam, 4,
                            {"max_in_cpu": 0})
    assert streamed.host == big.host - 4 * n
    assert parse_link("intra=1,inter=1,drive=2").drive == 2e9


def test_the_commits_host_bytes_are_what_a_commit_holds() -> None:
    """With an ``elastic`` table the plan names the host memory of training in place: two commits of the model and
    its optimizer state, each what a commit really copies (the own loop's `take`, the Trainer's content)."""
    from polytrain.adapters.torch.models import build_model
    from polytrain.plan.census import model_info
    from polytrain.torch import Distributed
    from polytrain.torch.elastic import take

    spec = validation.from_dict({"framework": "torch", "model": {"name": "mlp"}, "data": {"name": "digits"},
                                 "optimizer": {"name": "adam", "lr": 0.01}, "elastic": {"min_np": 1}})
    doc = plan(spec, 2, 1, 80 * 2**30, Link())
    assert "elastic commits:" in table(doc) and plan(validation.from_dict({**spec.to_dict(), "elastic": None}), 2, 1,
                                                     80 * 2**30, Link())["elastic_commit_bytes"] is None
    with Distributed("local") as dist:
        net = build_model("mlp", dict(spec.model.params), model_info(spec))
        model, optimizer = dist.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
        dist.backward(model(torch.randn(4, *model_info(spec).input_shape)).square().mean())
        optimizer.step()
        commit = take(dist._loop_state(), 1, {})
    held = sum(t.nbytes for t in commit.model.values()) + sum(t.nbytes for t in commit.optimizer.values()
                                                                if t.ndim)  # Adam's step counters: scalars
    assert doc["elastic_commit_bytes"] == 2 * held
