"""Credentials in URIs never leave a run in clear (issue 48 item 7): `polytrain.observe.redact` masks the user-info of
every URI (and secret query parameters) in any string; the spec as written (``to_dict``), hashed (``digest``) and
every one-line error are masked, while the spec the run uses keeps the real value."""

from __future__ import annotations

import pytest

from polytrain import validation
from polytrain.errors import SpecError, TrainingFailure, UserError
from polytrain.observe.redact import holds_secret, redact_text, redacted

CASES = [  # what a spec or a message may hold -> what is shown
    ("postgresql://user:PASSWORD@host:5432/db", "postgresql://user:***@host:5432/db"),
    ("mysql+pymysql://u:p%40ss@db.example/mlflow?charset=utf8", "mysql+pymysql://u:***@db.example/mlflow?charset=utf8"),
    ("s3://AKIAKEY:SECRET/with/slash@bucket/data.npz", "s3://AKIAKEY:***@bucket/data.npz"),
    ("postgresql://user:p@ss@host/db", "postgresql://user:***@host/db"),  # an unescaped @ in the password
    ("https://ghp_TOKEN@github.com/org/repo.git", "https://***@github.com/org/repo.git"),  # a token alone
    ("postgresql://host/db?user=u&password=PASSWORD&sslmode=require",
     "postgresql://host/db?user=u&password=***&sslmode=require"),
    ("https://bucket.s3.amazonaws.com/x?X-Amz-Credential=AK&X-Amz-Signature=SIG&v=1",
     "https://bucket.s3.amazonaws.com/x?X-Amz-Credential=***&X-Amz-Signature=***&v=1"),
    ("cannot open the tracking store postgresql://user:PASSWORD@127.0.0.1:1/db (OperationalError: ...)",
     "cannot open the tracking store postgresql://user:***@127.0.0.1:1/db (OperationalError: ...)"),
    ("data.path: 'gs://k:PASSWORD@bucket/x' not found", "data.path: 'gs://k:***@bucket/x' not found"),
]
UNCHANGED = ["sqlite:///runs/mlflow.db", "file:///a/b@c/d", "https://medium.com/@user", "http://host:5000",
             "runs/polytrain", "user@host", "s3://bucket/dir/@file", "no uri at all: a:b@c"]


@pytest.mark.parametrize(("text", "shown"), CASES)
def test_every_credential_in_a_uri_is_masked(text: str, shown: str) -> None:
    assert redact_text(text) == shown
    assert redact_text(shown) == shown  # masking twice changes nothing
    assert "PASSWORD" not in shown and "SECRET" not in shown and "TOKEN" not in shown


@pytest.mark.parametrize("text", UNCHANGED)
def test_what_holds_no_credential_is_left_as_it_is(text: str) -> None:
    assert redact_text(text) == text and not holds_secret(text)


def test_plain_data_is_masked_through_tables_and_lists() -> None:
    data = {"a": ["x", ("postgresql://u:PASSWORD@h/d",)], "b": {"c": "s3://k:PASSWORD@b/x"}, "n": 3, "f": None}
    assert redacted(data) == {"a": ["x", ("postgresql://u:***@h/d",)], "b": {"c": "s3://k:***@b/x"}, "n": 3,
                              "f": None}


def test_the_spec_is_written_and_hashed_masked_but_used_as_given() -> None:
    uri = "postgresql://user:PASSWORD@127.0.0.1:1/db"
    spec = validation.from_dict({"logging": {"mlflow": {"tracking_uri": uri}}, "data": {"name": "digits"}})
    assert spec.logging.mlflow is not None and spec.logging.mlflow.tracking_uri == uri  # what MLflow gets
    assert spec.to_dict()["logging"]["mlflow"]["tracking_uri"] == "postgresql://user:***@127.0.0.1:1/db"
    assert spec.to_dict(redact=False)["logging"]["mlflow"]["tracking_uri"] == uri
    other = validation.from_dict({"logging": {"mlflow": {"tracking_uri": uri.replace("PASSWORD", "rotated")}}})
    assert other.digest() == spec.digest() and other.model_digest() == spec.model_digest()  # no hash of a password


def test_every_one_line_error_is_masked() -> None:
    for error in (UserError, SpecError, TrainingFailure):
        assert str(error("logging.mlflow: cannot open postgresql://u:PASSWORD@h/db")) == \
            "logging.mlflow: cannot open postgresql://u:***@h/db"
