"""``flatpack.data``: shard directories (safetensors, .pt, .npz), Dataset factories and
DataLoaders as a run's batches: epochs, seeded shuffling, drop_last, the layout of inputs
and targets, and the errors given before any process starts. Also ``flatpack.weights``:
tied weights saved once and loaded back under every name."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import flatpack
from flatpack.data import (MAX_SYNTHETIC_ELEMENTS, Batches, DatasetFactory, ShardDirectory, SyntheticSource,
                           batches_from_record, check_against_example, loader_batches, make_batches, parse_source,
                           source_from_json)
from flatpack.errors import InputError
from flatpack.job import JobOptions, choose_loss, synthetic_source, training_data
from flatpack.analysis.reference import first_output
from flatpack.rundir import MAX_ITERATIONS


class Keyword(nn.Module):
    """A keyword-input model that computes its own loss from labels, as HuggingFace's do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> dict:
        logits = self.head(self.embed(input_ids).mean(1))
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": nn.functional.cross_entropy(logits, labels), **out}
        return out


KEYWORD_EXAMPLE = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)}


def write_shards(root: Path, rows: tuple[int, ...] = (6, 4, 6), target: bool = True) -> torch.Tensor:
    """Shards of one kind each (safetensors, .pt, .npz) whose input_ids' first column numbers
    the samples 0..N-1, so a test can see which samples a batch holds."""
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for index, count in enumerate(rows):
        ids = torch.randint(0, 20, (count, 5))
        ids[:, 0] = torch.arange(start, start + count)
        named = {"input_ids": ids, "attention_mask": torch.ones(count, 5), "labels": ids[:, 1] % 3}
        if not target:
            named.pop("labels")
        kind = index % 3
        if kind == 0:
            save_file(named, str(root / f"part-{index}.safetensors"))
        elif kind == 1:
            torch.save(named, root / f"part-{index}.pt")
        else:
            arrays = {key: value.numpy() for key, value in named.items()}
            # allow_pickle is numpy's default, named so that the arrays cannot be taken for it
            np.savez(root / f"part-{index}.npz", allow_pickle=True, **arrays)
        start += count
    return torch.arange(start)


def sample_ids(batches: Batches, index: int) -> list[int]:
    return batches(index)[0]["input_ids"][:, 0].tolist()


def test_a_shard_directory_gives_every_sample_once_per_epoch_shuffled_by_seed(tmp_path):
    write_shards(tmp_path / "shards")
    source = parse_source(str(tmp_path / "shards"))
    assert isinstance(source, ShardDirectory)
    batches = make_batches(source, Keyword(), KEYWORD_EXAMPLE, batch=4, epochs=2, seed=3)
    assert len(batches) == 8 and batches.per_epoch == 4
    first = [sample_ids(batches, i) for i in range(4)]
    second = [sample_ids(batches, i) for i in range(4, 8)]
    assert sorted(itertools.chain(*first)) == list(range(16)) == sorted(itertools.chain(*second))
    assert first != second, "each epoch is reshuffled"
    again = make_batches(parse_source(str(tmp_path / "shards")), Keyword(), KEYWORD_EXAMPLE, batch=4, epochs=2, seed=3)
    assert [sample_ids(again, i) for i in range(4)] == first, "the same seed gives the same order"
    ordered = make_batches(source, Keyword(), KEYWORD_EXAMPLE, batch=4, shuffle=False)
    assert [sample_ids(ordered, i) for i in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                         [12, 13, 14, 15]]
    inputs, target = ordered(0)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"} and target is None


def test_the_last_partial_batch_is_refused_unless_dropped(tmp_path):
    write_shards(tmp_path / "shards", rows=(6, 4, 7))
    source = parse_source(str(tmp_path / "shards"))
    with pytest.raises(InputError,
                       match=r"17 samples.*last batch of each epoch would have 1 instead of 4.*--drop-last"):
        make_batches(source, Keyword(), KEYWORD_EXAMPLE, batch=4)
    batches = make_batches(source, Keyword(), KEYWORD_EXAMPLE, batch=4, drop_last=True, shuffle=False)
    assert len(batches) == 4 and sample_ids(batches, 3) == [12, 13, 14, 15]


def test_shard_errors_name_the_cause_and_the_fix(tmp_path):
    with pytest.raises(InputError, match="no such directory"):
        parse_source(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no shards"):
        make_batches(parse_source(str(tmp_path / "empty")), Keyword(), KEYWORD_EXAMPLE, batch=2)
    write_shards(tmp_path / "mixed", rows=(4,))
    save_file({"input_ids": torch.zeros(4, 6, dtype=torch.long), "attention_mask": torch.ones(4, 6),
               "labels": torch.zeros(4, dtype=torch.long)}, str(tmp_path / "mixed" / "part-9.safetensors"))
    with pytest.raises(InputError, match=r"part-9.safetensors does not match.*'attention_mask' has shape \(rows, 6\)"):
        make_batches(parse_source(str(tmp_path / "mixed")), Keyword(), KEYWORD_EXAMPLE, batch=2)
    (tmp_path / "extra").mkdir()
    save_file({"input_ids": torch.zeros(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5),
               "pixels": torch.zeros(4)}, str(tmp_path / "extra" / "a.safetensors"))
    with pytest.raises(InputError, match=r"tensors \['pixels'\] that Keyword.forward does not take"):
        make_batches(parse_source(str(tmp_path / "extra")), Keyword(), KEYWORD_EXAMPLE, batch=2)
    torch.save([1, 2, 3], tmp_path / "extra" / "b.pt")
    with pytest.raises(InputError, match="a .pt shard must be a dict of named tensors"):
        ShardDirectory(tmp_path / "extra").scan()


def test_a_positional_model_takes_its_input_and_the_target_from_a_pt_pair(tmp_path):
    (tmp_path / "pairs").mkdir()
    torch.save((torch.randn(8, 3), torch.randint(0, 2, (8,))), tmp_path / "pairs" / "a.pt")
    model = nn.Linear(3, 2)
    batches = make_batches(parse_source(str(tmp_path / "pairs")), model, (torch.randn(2, 3),), batch=4)
    inputs, target = batches(1)
    assert isinstance(inputs, tuple) and inputs[0].shape == (4, 3) and target.shape == (4,)
    assert choose_loss(model, inputs, target, "auto") == "cross_entropy"
    assert choose_loss(model, inputs, torch.randn(4, 2), "auto") == "mse"


def test_the_loss_is_the_models_own_when_it_has_one(tmp_path):
    write_shards(tmp_path / "shards", rows=(4,))
    inputs, target = make_batches(parse_source(str(tmp_path / "shards")), Keyword(), KEYWORD_EXAMPLE, batch=4)(0)
    assert choose_loss(Keyword(), inputs, target, "auto") == "output"
    with pytest.raises(InputError, match="returns its own loss.*--loss mse cannot apply"):
        choose_loss(Keyword(), inputs, target, "mse")
    no_labels = {key: value for key, value in inputs.items() if key != "labels"}
    with pytest.raises(InputError, match="no targets .* and the model computes no loss"):
        choose_loss(Keyword(), no_labels, None, "auto")


class Squares(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(index)), torch.tensor(float(index) ** 2)


class Stream(IterableDataset):
    def __iter__(self):
        for index in range(6):
            yield {"input_ids": torch.full((5,), index), "attention_mask": torch.ones(5),
                   "labels": torch.tensor(index % 3)}


def squares() -> Dataset:
    return Squares()


def stream() -> IterableDataset:
    return Stream()


def test_dataset_factories_map_style_and_iterable(monkeypatch):
    monkeypatch.setitem(sys.modules, "fp_test_datasets", sys.modules[__name__])
    source = parse_source("fp_test_datasets:squares")
    assert isinstance(source, DatasetFactory)
    batches = make_batches(source, nn.Linear(3, 1), (torch.randn(2, 3),), batch=5, epochs=2, seed=1)
    seen = sorted(int(v) for i in range(2) for v in batches(i)[0][0][:, 0])
    assert len(batches) == 4 and seen == list(range(10))
    with pytest.raises(InputError, match="has no len\\(\\), so the number of iterations is unknown; give --iterations"):
        make_batches(parse_source("fp_test_datasets:stream"), Keyword(), KEYWORD_EXAMPLE, batch=2)
    streamed = make_batches(parse_source("fp_test_datasets:stream"), Keyword(), KEYWORD_EXAMPLE, batch=2,
                            iterations=6)
    assert len(streamed) == 6    # three batches an epoch: the stream starts again after them
    assert [streamed(i)[0]["input_ids"][:, 0].tolist() for i in (0, 4, 1)] == [[0, 1], [2, 3], [2, 3]]
    with pytest.raises(InputError, match="must return a torch.utils.data.Dataset"):
        monkeypatch.setattr(sys.modules[__name__], "not_a_dataset", lambda: [1, 2], raising=False)
        parse_source("fp_test_datasets:not_a_dataset")


def test_a_dataloader_gives_its_own_batches():
    loader = DataLoader(Squares(), batch_size=5, shuffle=False)
    batches = make_batches(parse_source(loader), nn.Linear(3, 1), (torch.randn(2, 3),), batch=5, epochs=3)
    assert len(batches) == 6 and batches.source.to_json() is None
    assert batches(3)[0][0][:, 0].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_a_run_record_reads_the_same_batches_again_without_the_model(tmp_path):
    write_shards(tmp_path / "shards")
    batches = make_batches(parse_source(str(tmp_path / "shards")), Keyword(), KEYWORD_EXAMPLE, batch=4, epochs=2,
                           seed=5)
    record = {"source": batches.source.to_json(), "batch": 4, "epochs": 2, "iterations": None, "shuffle": True,
              "seed": 5, "drop_last": False, "layout": batches.layout_json()}
    again = batches_from_record(record)
    for index in (0, 5, 7):
        assert torch.equal(again(index)[0]["input_ids"], batches(index)[0]["input_ids"])


def _same_batch(first: tuple, second: tuple) -> bool:
    (inputs, target), (other_inputs, other_target) = first, second
    leaves = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    other = list(other_inputs.values()) if isinstance(other_inputs, dict) else list(other_inputs)
    if target is None or other_target is None:
        same_target = target is None and other_target is None
    else:
        same_target = torch.equal(target, other_target)
    return same_target and all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                               for a, b in zip(leaves, other))


@pytest.mark.parametrize("model, example, loss", [
    (nn.Linear(3, 4), (torch.randn(2, 3),), "cross_entropy"),
    (nn.Conv2d(3, 2, 3), (torch.randn(2, 3, 6, 6),), "mse"),
    (Keyword(), KEYWORD_EXAMPLE, "cross_entropy"),
    (Keyword(), {**KEYWORD_EXAMPLE, "labels": torch.tensor([0, 2])}, "output"),
])
def test_synthetic_batches_are_drawn_when_asked_the_same_each_time_and_again_from_their_record(model, example,
                                                                                                loss):
    """A run without --data trains on batches drawn one at a time: as many iterations as a
    record allows cost nothing up front (the run directory had kept a copy of every batch:
    78 GB for 100,000 of the reduced vgg16's at batch 64), each batch is the same whenever it
    is drawn, and the record's JSON draws the same batches again (what `flatpack resume` does)."""
    options = JobOptions.of(batch=8, iterations=MAX_ITERATIONS, seed=3)
    batches, chosen, count = training_data(model, example, options)
    assert chosen == loss and count == len(batches) == MAX_ITERATIONS
    assert isinstance(batches, Batches) and isinstance(batches.source, SyntheticSource)
    assert _same_batch(batches(7), batches(7)) and not _same_batch(batches(7), batches(8))
    assert _same_batch(batches(MAX_ITERATIONS - 1), batches(MAX_ITERATIONS - 1))
    inputs, target = batches(7)
    leaves = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    examples = list(example.values()) if isinstance(example, dict) else list(example)
    for leaf, shown in zip(leaves, examples):
        assert leaf.shape == (8, *shown.shape[1:]) and leaf.dtype == shown.dtype
        if not shown.is_floating_point():
            assert int(leaf.min()) >= 0 and int(leaf.max()) <= max(int(shown.max()), 1)
    if loss == "cross_entropy":
        assert target.shape == (8,) and target.dtype == torch.int64 and int(target.max()) < 4
        assert int(target.max()) < first_output(model(*examples) if not isinstance(example, dict)
                                                else model(**example)).shape[-1]
    elif loss == "mse":
        assert target.shape == (8, 2, 4, 4) and target.is_floating_point()
    else:
        assert target is None
    record = {"source": json.loads(json.dumps(batches.source.to_json())), "batch": 8, "epochs": 1,
              "iterations": count, "shuffle": True, "seed": 3, "drop_last": False, "layout": None}
    again = batches_from_record(record)
    assert len(again) == count and again.source.fingerprint() == batches.source.fingerprint()
    assert all(_same_batch(again(index), batches(index)) for index in (0, 7, count - 1))
    other = synthetic_source(model, example, seed=4)[0]
    assert other.fingerprint() != batches.source.fingerprint()


@pytest.mark.parametrize("change, message", [
    ({"dtype": "torch.complex64"}, "dtype must be one of"),
    ({"dtype": "__import__('os')"}, "dtype must be one of"),
    ({"shape": [0, 3]}, "positive sizes"),
    ({"shape": [MAX_SYNTHETIC_ELEMENTS, 2]}, "elements per sample"),
    ({"shape": "3"}, "positive sizes"),
    ({"high": 5}, "a floating one has no high"),
    ({"code": "x"}, "dtype must be one of"),
])
def test_a_synthetic_record_flatpack_would_not_write_is_refused_naming_the_leaf(change, message):
    leaf = {"shape": [3], "dtype": "torch.float32", **change}
    with pytest.raises(InputError, match=message) as refused:
        source_from_json({"kind": "synthetic", "inputs": [leaf], "names": None, "target": None, "seed": 0})
    assert "input 0" in str(refused.value)


def test_an_example_leaf_synthetic_batches_cannot_draw_is_refused_naming_it():
    class TakesAList(nn.Module):
        def forward(self, x, sizes):
            return x * len(sizes)

    with pytest.raises(InputError, match="example's input 1 is a list.*--data"):
        SyntheticSource.like((torch.randn(2, 3), [1, 2]), torch.randn(2, 3), "mse", 0)


def test_run_options_for_data_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(InputError, match="--epochs, --drop-last and --store-endpoint apply to --data"):
        JobOptions.of(epochs=2).check()
    with pytest.raises(InputError, match="--save .*name the file \\*.safetensors"):
        JobOptions.of(save=tmp_path / "w.pt").check()
    with pytest.raises(InputError, match="--loss must be auto"):
        JobOptions.of(loss="hinge").check()
    with pytest.raises(InputError, match="a loss function named by module is not supported"):
        JobOptions.of(loss="no_such_module_fp:focal").check()
    JobOptions.of(data=str(tmp_path), iterations=None, epochs=2, drop_last=True, loss="cross-entropy").check()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def test_tied_weights_are_saved_once_and_loaded_under_every_name(tmp_path):
    model = Tied()
    path = flatpack.save_state_dict(model.state_dict(), tmp_path / "w.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        assert sorted(handle.keys()) == ["embed.weight", "steps"]
    state = flatpack.load_state_dict(path)
    assert set(state) == set(model.state_dict())
    fresh = Tied()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.out.weight, model.out.weight)
    with pytest.raises(InputError, match="no weights file"):
        flatpack.load_state_dict(tmp_path / "missing.safetensors")


def test_data_the_model_was_not_written_for_is_refused_before_compiling(tmp_path):
    example = (torch.randn(2, 3),)
    with pytest.raises(InputError, match=r"--data x: input 0 has dtype float64, but the model's example has "
                                         r"float32.*astype"):
        check_against_example(example, (torch.randn(4, 3, dtype=torch.float64),), "--data x")
    with pytest.raises(InputError, match=r"input 0 has shape \(4, 3, 1\), 3 dimensions, but the model's example has 2: "
                                         r"\(2, 3\)"):
        check_against_example(example, (torch.randn(4, 3, 1),), "--data x")
    with pytest.raises(InputError, match="'attention_mask'|attention_mask .* is missing"):
        check_against_example(KEYWORD_EXAMPLE, {"input_ids": torch.zeros(4, 9, dtype=torch.long)}, "--data x")
    # another sequence length is fine: the model is compiled with the data's first batch
    check_against_example(KEYWORD_EXAMPLE, {"input_ids": torch.zeros(4, 9, dtype=torch.long),
                                            "attention_mask": torch.ones(4, 9)}, "--data x")


def test_a_dataloader_of_dict_samples_binds_them_by_name_without_the_model():
    loader = DataLoader(Stream(), batch_size=2)
    batches = loader_batches(loader, iterations=4)
    inputs, target = batches(3)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"} and target is None
    assert inputs["input_ids"][:, 0].tolist() == [0, 1]      # the fourth batch: the second epoch's first


def test_a_loss_named_by_module_and_function_is_refused_before_anything_imports_it():
    """The loss reaches the workers in the run's settings, which live in the store: a worker
    never imports code that data names (docs/security.md), so only named losses exist."""
    import sys

    from flatpack.runtime.optim import check_loss

    with pytest.raises(InputError, match="a loss function named by module is not supported.*'output'"):
        check_loss("fp_never_imported_module:focal")
    assert "fp_never_imported_module" not in sys.modules
    assert check_loss("mse") == "mse"


def test_a_file_factory_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text("import torch\nfrom torch.utils.data import TensorDataset\n"
                                        "def make():\n    return TensorDataset(torch.randn(8, 3), torch.randn(8, 1))\n")
    monkeypatch.chdir(tmp_path)
    source = parse_source("mydata.py:make")
    assert source.to_json() == {"kind": "factory", "spec": f"{tmp_path.resolve() / 'mydata.py'}:make"}
    batches = make_batches(source, nn.Linear(3, 1), (torch.randn(2, 3),), batch=4)
    assert len(batches) == 2 and batches(1)[1].shape == (4, 1)


def test_a_factory_source_is_never_imported_from_a_record(tmp_path, monkeypatch):
    """run.json is data: a resume names the factory again, and it must be the recorded one."""
    (tmp_path / "mydata.py").write_text("import torch\nfrom torch.utils.data import TensorDataset\n"
                                        "def make():\n    return TensorDataset(torch.randn(8, 3), torch.randn(8, 1))\n")
    (tmp_path / "other.py").write_text("raise SystemExit('other.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    record = parse_source("mydata.py:make").to_json()
    assert record is not None, "a factory source is recorded by its name"
    # the recorded reference is never offered back as a command (someone may have edited it)
    with pytest.raises(InputError, match="--data MODULE:FACTORY") as unnamed:
        source_from_json(record)
    assert "mydata" not in str(unnamed.value)
    with pytest.raises(InputError, match="is not the factory this run recorded"):
        source_from_json(record, factory="other.py:make")
    assert source_from_json(record, factory="mydata.py:make").to_json() == record
