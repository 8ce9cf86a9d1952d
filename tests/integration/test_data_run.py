"""Data in and weights out on the command line and in Python: ``flatpack run`` trains a
HuggingFace model with keyword inputs (input_ids, attention_mask, labels: its own loss) on
shards from a directory and from an ``s3://`` prefix of the local S3 server, saves the
original model's state_dict, and the original model loads it; a DataLoader trains a
deployment whose ``state_dict()`` makes the original model give the staged model's outputs.
``plan``, ``profile`` and ``demo`` take the same keyword-input model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

import flatpack
from flatpack.backends import local
from flatpack.cli import main
from flatpack.data import make_batches, parse_source
from flatpack.examples import bert
from flatpack.job import without_dropout

pytestmark = pytest.mark.slow

SEQ, VOCAB = 16, 512


def token_shards(root: Path, shards: int = 2, rows: int = 8) -> None:
    """Masked-LM shards: a safetensors one and a .pt one, labels = the tokens."""
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    for index in range(shards):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
        named = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        if index % 2:
            torch.save(named, root / f"part-{index}.pt")
        else:
            save_file(named, str(root / f"part-{index}.safetensors"))


# one epoch of the two shards (2 iterations); --epochs itself: test_data.py and test_training_knobs.py
RUN = ["--batch", "8", "--micro-batches", "2", "--replicas", "1", "--solver", "balanced", "--epochs", "1"]


def loads_into_the_original_model(path: Path) -> torch.nn.Module:
    model, _ = bert()
    state = flatpack.load_state_dict(path)
    model.load_state_dict(state)     # strict: every key of the model's state_dict, tied weights included
    initial, _ = bert()
    trained = "bert.encoder.layer.0.output.dense.weight"
    assert not torch.equal(model.get_parameter(trained), initial.get_parameter(trained)), "the weights were trained"
    assert model.get_parameter("cls.predictions.decoder.weight") is model.get_parameter(
        "bert.embeddings.word_embeddings.weight")
    return model


def test_run_trains_bert_on_a_shard_directory_saves_weights_and_resume_rereads_the_data(tmp_path, capsys):
    token_shards(tmp_path / "shards")
    out, saved = tmp_path / "run", tmp_path / "bert.safetensors"
    assert main(["run", "bert", "--data", str(tmp_path / "shards"), *RUN, "--out", str(out),
                 "--save", str(saved)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "data: shards in" in captured.err and "loss: the model output's own" in captured.err
    assert "passed: equivalent (2 stages" in printed, printed[-3000:]
    loads_into_the_original_model(saved)
    # the run directory records the source, not a copy of the data
    record = json.loads((out / "run.json").read_text())
    assert record["data"]["source"] == {"kind": "directory", "path": str((tmp_path / "shards").resolve())}
    assert not (out / "batches.safetensors").exists()
    # a resume (here: of a run whose store is gone before training) reads the shards again
    first = flatpack.load_state_dict(out / "trained.safetensors")
    (out / "run.json").write_text(json.dumps({**record, "state": "running"}))
    (out / "store").mkdir()
    assert main(["resume", str(out)]) == 0
    assert "re-reading the run's data: shards in" in capsys.readouterr().err
    again = flatpack.load_state_dict(out / "trained.safetensors")
    # the same batches, micro-batches and settings: the same weights, bit for bit (a resume that
    # defaulted to one micro-batch differed by 1.4e-5 through Adam's division by sqrt(v))
    for name, value in first.items():
        assert torch.equal(again[name], value), name


def test_run_reads_shards_from_an_s3_prefix(s3_server, tmp_path, capsys, monkeypatch):
    token_shards(tmp_path / "shards")
    prefix = f"data-{tmp_path.name}/train/"
    with s3_server.store(prefix=prefix) as store:
        for path in sorted((tmp_path / "shards").iterdir()):
            store.put(path.name, path.read_bytes())
    for name, value in s3_server.env().items():      # the standard AWS variables name the credentials
        monkeypatch.setenv(name, value)
    saved = tmp_path / "bert.safetensors"
    assert main(["run", "bert", "--data", f"s3://{s3_server.bucket}/{prefix}", "--store-endpoint",
                 s3_server.endpoint_url, *RUN, "--out", str(tmp_path / "run"), "--save", str(saved)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert f"data: shards in s3://{s3_server.bucket}/{prefix} at {s3_server.endpoint_url}" in captured.err
    assert "passed: equivalent (2 stages" in printed, printed[-3000:]
    loads_into_the_original_model(saved)


class Tokens(Dataset):
    """Dict samples, as a HuggingFace tokenized dataset gives them."""

    def __init__(self, rows: int = 16) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.ids[index]}


def test_a_dataloader_trains_a_deployment_whose_state_dict_gives_the_original_model_its_outputs(s3_server):
    model, example = bert()
    without_dropout(model)
    loader = DataLoader(Tokens(), batch_size=8, shuffle=False)
    first = make_batches(parse_source(loader), model, example, batch=8)(0)[0]
    compiled = flatpack.compile(model, first, stages=2)
    probe = {"input_ids": Tokens().ids[:4], "attention_mask": torch.ones(4, SEQ, dtype=torch.long)}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        # train() takes the DataLoader itself: two epochs of its two batches
        # (train's annotation lists sequences and callables only, though it reads a DataLoader)
        result = deployment.train(loader,  # pyright: ignore[reportArgumentType]
                                  iterations=4, optimizer={"name": "adam", "lr": 0.01}, loss="output",
                                  micro_batches=2, wait_timeout_s=60, timeout_s=180)
        assert len(result.losses) == 4
        state = deployment.state_dict()
        staged = deployment.infer({**probe, "labels": probe["input_ids"]})
    original, _ = bert()
    original.load_state_dict(state)
    assert set(state) == set(original.state_dict())
    with torch.no_grad():
        expected = original.eval()(**probe, labels=probe["input_ids"])
    torch.testing.assert_close(staged["logits"], expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(staged["loss"], expected.loss, rtol=1e-4, atol=1e-5)


def test_plan_profile_and_demo_take_a_keyword_input_model(tmp_path, capsys):
    assert main(["profile", "bert", "--repeats", "1", "--batch-sizes", "1,2"]) == 0
    assert "cls.predictions.decoder" in capsys.readouterr().out
    assert main(["plan", "bert", "--target", "aws-lambda", "--split-points", "bert.encoder.layer.2", "--repeats", "1",
                 "--batch-sizes", "1,2"]) == 0
    assert "the cuts asked for (split-points bert.encoder.layer.2)" in capsys.readouterr().out
    assert main(["demo", "--model", "bert", "--iterations", "2", "--out", str(tmp_path / "demo")]) == 0
    assert "passed: equivalent" in capsys.readouterr().out
