"""Every supported batch and output structure is split and gathered back exactly."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import lightning_mgpu
from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, merge_outputs, split_batch
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    SharedStateError,
    argument_roots,
    batch_size_of,
    move_to,
    shared_state,
    split_arguments,
    split_or_run_once,
    split_sizes,
)

CPU4 = ["cpu"] * 4
Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "train"


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor
    derived: int = dataclasses.field(init=False, default=7)


def assert_same(a, b, path="x"):
    """Structural equality: same types all the way down, tensors equal (and same dtype)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


def test_split_sizes_are_tensor_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(3, 4) == [1, 1, 1]  # fewer replicas, never an empty chunk
    assert split_sizes(5, 1) == [5]
    assert [len(c) for c in torch.arange(10).tensor_split(4)] == split_sizes(10, 4)


def nested_batch(n: int = 10):
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(n, *shape, generator=g).to(dtype)

    return {
        "tuple": (t(3), t(2, 2)),
        "list": [t(1), t(4, dtype=torch.float64)],
        "pair": Pair(t(2), torch.arange(n)),
        "sample": Sample(t(1, 4, 4), torch.arange(n) % 3),
        "frozen": Frozen(t(2)),
        "nested": OrderedDict(deep=[{"ids": torch.arange(n), "mask": torch.ones(n, 5, dtype=torch.bool)}]),
        "names": [f"s{i}" for i in range(n)],
        "constants": {"epoch": 3, "tag": "x", "none": None, "classes": ["cat", "dog"]},
    }


def test_scatter_every_structure():
    batch = nested_batch(10)
    chunks, sizes = split_batch(batch, CPU4)
    assert sizes == [3, 3, 2, 2]
    start = 0
    for chunk, size in zip(chunks, sizes, strict=True):
        rows = slice(start, start + size)
        assert isinstance(chunk, dict) and list(chunk) == list(batch)
        assert isinstance(chunk["tuple"], tuple) and torch.equal(chunk["tuple"][1], batch["tuple"][1][rows])
        assert isinstance(chunk["list"], list) and chunk["list"][1].dtype == torch.float64
        assert type(chunk["pair"]) is Pair and torch.equal(chunk["pair"].right, torch.arange(10)[rows])
        assert type(chunk["sample"]) is Sample and chunk["sample"].image.shape == (size, 1, 4, 4)
        assert chunk["sample"].name == "train"
        assert type(chunk["frozen"]) is Frozen and chunk["frozen"].derived == 7
        assert type(chunk["nested"]) is OrderedDict
        assert torch.equal(chunk["nested"]["deep"][0]["ids"], torch.arange(10)[rows])
        assert chunk["names"] == [f"s{i}" for i in range(start, start + size)]  # split with the batch
        assert chunk["constants"] == {"epoch": 3, "tag": "x", "none": None, "classes": ["cat", "dog"]}
        start += size
    assert [len(c["names"]) for c in chunks] == [3, 3, 2, 2]


def test_gather_reverses_scatter_exactly():
    batch = nested_batch(10)
    for n in (1, 2, 3, 4):
        chunks, _ = split_batch(batch, ["cpu"] * n)
        assert_same(merge_outputs(chunks, "cpu"), batch)
    small = nested_batch(3)  # fewer samples than devices: 3 chunks
    chunks, sizes = split_batch(small, CPU4)
    assert sizes == [1, 1, 1]
    assert_same(merge_outputs(chunks, "cpu"), small)


def test_zero_dim_tensors_are_replicated_and_averaged_back_by_sample_count():
    scale = torch.tensor(2.5)
    chunks, _ = split_batch({"x": torch.arange(10.0), "scale": scale}, CPU4)
    assert all(c["scale"].dim() == 0 and c["scale"].item() == 2.5 for c in chunks)
    # A 0-dim output (e.g. a per-replica mean loss) becomes one value, weighted by each replica's sample count.
    assert torch.equal(merge_outputs([torch.tensor(1.0), torch.tensor(2.0)], "cpu"), torch.tensor(1.5))
    assert merge_outputs([torch.tensor(1.0), torch.tensor(2.0)], "cpu", sizes=[3, 1]).item() == pytest.approx(1.25)
    assert merge_outputs([{"n": torch.tensor(4.0)}, {"n": torch.tensor(4.0)}], "cpu")["n"].item() == 4.0  # equal: as is


@pytest.mark.parametrize("as_tensor", [False, True])
def test_integer_step_outputs_are_counts_that_add_up_as_one_device_counts(as_tensor):
    """correct / total / len(x) returned from a step: one device's count over the whole batch is the shards' sum."""
    wrap = torch.tensor if as_tensor else int
    out = [{"correct": wrap(4), "total": wrap(6)}, {"correct": wrap(3), "total": wrap(5)}]
    merged = merge_outputs(out, "cpu", sizes=[6, 5])
    assert int(merged["correct"]) == 7 and int(merged["total"]) == 11
    even = merge_outputs([{"total": wrap(5)}, {"total": wrap(5)}], "cpu", sizes=[5, 5])  # len(x) on even shards
    assert int(even["total"]) == 10
    with pytest.warns(UserWarning, match=r"output\['epoch'\]: the same integer on every device.*\(pred == y\)"):
        same = merge_outputs([{"epoch": wrap(3)}, {"epoch": wrap(3)}], "cpu", sizes=[5, 5])  # a constant: kept
    assert int(same["epoch"]) == 3


def test_non_tensor_values_passed_whole_and_gathered():
    marker = object()
    chunks, _ = split_batch((torch.zeros(6, 2), marker, "text", 4, ["a", "b"]), ["cpu"] * 3)
    assert all(c[1] is marker and c[2] == "text" and c[3] == 4 and c[4] == ["a", "b"] for c in chunks)
    # Different numbers are averaged by sample count (here 1 each), integers that differ (counts) summed; other values
    # come back one per replica.
    assert merge_outputs([{"x": torch.zeros(1), "k": 1.0}, {"x": torch.zeros(1), "k": 2.0}], "cpu")["k"] == 1.5
    assert merge_outputs([{"x": torch.zeros(1), "k": 1}, {"x": torch.zeros(1), "k": 2}], "cpu")["k"] == 3
    merged = merge_outputs([{"x": torch.zeros(1), "k": "a"}, {"x": torch.zeros(1), "k": "b"}], "cpu")["k"]
    assert isinstance(merged, lightning_mgpu.ReplicaValues) and list(merged) == ["a", "b"]
    # Lists of plain items with no tensor beside them are concatenated.
    assert merge_outputs([["a", "b"], ["c"]], "cpu") == ["a", "b", "c"]


def test_outputs_padded_to_each_shards_length_come_back_per_replica_with_how_to_pad_them_alike():
    merged = merge_outputs([torch.zeros(2, 5, 3), torch.zeros(2, 7, 3)], "cpu")
    assert isinstance(merged, lightning_mgpu.ReplicaValues) and [o.shape[1] for o in merged] == [5, 7]
    with pytest.raises(AttributeError, match=r"\(2, 5, 3\), \(2, 7, 3\)\] differ beyond dim 0.*total_length="):
        merged.size()
    plain = merge_outputs([object(), object()], "cpu")
    with pytest.raises(AttributeError, match="return per-sample values"):
        plain.size()


def test_flat_ids_with_offsets_are_refused_with_how_to_pass_bags_per_sample():
    ids, offsets = torch.arange(16), torch.tensor([0, 2, 5, 6, 9, 12, 15])
    with pytest.raises(BatchSplitError, match=r"has size 16 but batch\[1\] has size 7.*EmbeddingBag.*PerSample"):
        split_batch((ids, offsets), ["cpu"] * 2)
    bags = lightning_mgpu.PerSample(list(ids.tensor_split(offsets[1:])))  # the fix the message gives
    chunks, sizes = split_batch(bags, ["cpu"] * 2)
    assert sizes == [4, 3] and torch.equal(torch.cat([*chunks[0], *chunks[1]]), ids)


def test_tuples_of_per_sample_items_split_with_the_batch():
    """``images, ids = zip(*samples)`` collates ids into a tuple: it must travel with its samples."""
    ids = tuple(f"id{i}" for i in range(5))
    chunks, sizes = split_batch((torch.arange(5), ids), ["cpu"] * 2)
    assert sizes == [3, 2] and [c[1] for c in chunks] == [("id0", "id1", "id2"), ("id3", "id4")]
    gathered = merge_outputs(chunks, "cpu")  # the tensors beside the tuple give each replica's sample count
    assert torch.equal(gathered[0], torch.arange(5)) and gathered[1] == ids
    shape = Pair(32, 32)  # a namedtuple is a structure even when its length equals the batch size
    chunks, _ = split_batch((torch.zeros(2, 3), shape, (7, 7)), ["cpu"] * 2)
    assert all(c[1] == shape and type(c[1]) is Pair for c in chunks)
    assert [c[2] for c in chunks] == [(7, 7), (7, 7)]  # numbers in a tuple are an option (a size), not per-sample
    chunks, _ = split_batch((torch.zeros(2, 3), torch.Size([4, 4])), ["cpu"] * 2)
    assert all(c[1] == torch.Size([4, 4]) for c in chunks)


@pytest.mark.parametrize("samples", [2, 3, 5])
def test_per_sample_string_lists_collated_by_default_collate_follow_their_samples(samples):
    """``default_collate`` turns each sample's list of 2 tags into 2 tuples of one tag per sample; each replica gets
    its own samples' tags, also when the batch holds as many samples as there are tags."""
    from torch.utils.data import default_collate

    rows = [{"x": torch.tensor([float(i)]), "tags": [f"s{i}-a", f"s{i}-b"]} for i in range(samples)]
    chunks, _ = split_batch(default_collate(rows), ["cpu"] * 2)
    for chunk in chunks:
        ids = [int(i) for i in chunk["x"].flatten().tolist()]
        assert [tuple(tags) for tags in chunk["tags"]] == [tuple(f"s{i}-{t}" for i in ids) for t in "ab"]


def test_scatter_along_another_dim():
    x = torch.arange(24.0).reshape(2, 12)
    chunks, sizes = split_batch({"x": x, "bias": torch.ones(3)}, CPU4, dim=1)
    assert sizes == [3, 3, 3, 3] and chunks[0]["x"].shape == (2, 3)
    assert torch.equal(chunks[0]["bias"], torch.ones(3))  # 1-dim: no dim 1, replicated
    assert torch.equal(merge_outputs([c["x"] for c in chunks], "cpu", dim=1), x)


def test_scatter_is_differentiable():
    x = torch.randn(10, 3, requires_grad=True)
    chunks, _ = split_batch(x, CPU4)
    torch.cat([c * (i + 1) for i, c in enumerate(chunks)]).sum().backward()
    assert torch.equal(x.grad[:, 0], torch.tensor([1.0] * 3 + [2.0] * 3 + [3.0] * 2 + [4.0] * 2))


def test_scatter_args_and_move_to():
    args, kwargs, sizes = split_arguments((torch.arange(5),), {"mask": torch.ones(5), "flag": True}, ["cpu"] * 2)
    assert sizes == [3, 2]
    assert [a[0].tolist() for a in args] == [[0, 1, 2], [3, 4]]
    assert all(k["flag"] is True and k["mask"].shape[0] == s for k, s in zip(kwargs, sizes, strict=True))
    moved = move_to({"a": [torch.ones(2)], "b": Pair(torch.zeros(1), "s")}, "cpu")
    assert type(moved["b"]) is Pair and moved["b"].right == "s"
    assert batch_size_of(nested_batch(7)) == 7


class DictModel(nn.Module):
    """Consumes a dict batch with strings, returns dict / namedtuple / dataclass / nested outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3).double()

    def forward(self, batch):
        assert len(batch["names"]) == batch["x"].shape[0]
        logits = self.lin(batch["x"])
        return {
            "logits": logits,
            "pair": Pair(logits.sum(1), logits.argmax(1)),
            "sample": Sample(logits[:, None, :, None], batch["y"], name="out"),
            "names": [n.upper() for n in batch["names"]],
            "meta": ("const", [logits * 2]),
        }


@pytest.mark.parametrize("mode", ["threads", "sequential"])
def test_model_outputs_of_every_structure_gather_to_single_device(mode):
    g = torch.Generator().manual_seed(1)
    batch = {
        "x": torch.randn(10, 4, generator=g, dtype=torch.float64),
        "y": torch.arange(10),
        "names": list("abcdefghij"),
    }
    model = DictModel()
    expected = model(batch)
    dp_model = DataParallelModel(model, CPU4, execution_mode=mode)
    outputs = dp_model(batch)
    assert len(outputs) == 4 and [len(o["names"]) for o in outputs] == [3, 3, 2, 2]
    gathered = dp_model.gather(outputs)
    assert gathered["names"] == list("ABCDEFGHIJ")
    assert gathered["meta"][0] == "const"
    assert type(gathered["pair"]) is Pair and type(gathered["sample"]) is Sample
    assert gathered["sample"].name == "out"
    for key in ("logits",):
        assert torch.allclose(gathered[key], expected[key], atol=1e-12, rtol=0)
    assert torch.allclose(gathered["meta"][1][0], expected["meta"][1][0], atol=1e-12, rtol=0)
    assert torch.equal(gathered["sample"].label, expected["sample"].label)
    assert gathered["logits"].requires_grad  # gather is differentiable


def test_transformers_model_output():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    SequenceClassifierOutput = modeling_outputs.SequenceClassifierOutput

    class HFLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = nn.Linear(4, 6).double()
            self.head = nn.Linear(6, 3).double()

        def forward(self, input_ids=None, attention_mask=None):
            hidden = torch.tanh(self.encoder(input_ids)) * attention_mask[:, None]
            return SequenceClassifierOutput(logits=self.head(hidden), hidden_states=(hidden,))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(9, dtype=torch.float64)
    labels = torch.randint(0, 3, (9,), generator=g)
    reference, model = HFLike(), HFLike()
    expected = reference(input_ids=x, attention_mask=mask)
    ref_loss = nn.functional.cross_entropy(expected.logits, labels)
    ref_loss.backward()

    dp_model = DataParallelModel(model, CPU4)
    outputs = dp_model(input_ids=x, attention_mask=mask)
    assert all(type(o) is SequenceClassifierOutput for o in outputs)
    gathered = dp_model.gather(outputs)
    assert type(gathered) is SequenceClassifierOutput
    assert gathered.loss is None and list(gathered.keys()) == ["logits", "hidden_states"]
    assert isinstance(gathered.hidden_states, tuple) and gathered.hidden_states[0].shape == (9, 6)
    assert torch.allclose(gathered.logits, expected.logits, atol=1e-12, rtol=0)

    criterion = DataParallelCriterion(lambda out, y: nn.functional.cross_entropy(out.logits, y), CPU4)
    loss = criterion(outputs, labels)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-10
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        assert (p_ref.grad - p.grad).abs().max().item() < 1e-10

    # A ModelOutput as input is split like any mapping.
    chunks, _ = split_batch(SequenceClassifierOutput(logits=x), CPU4)
    assert all(type(c) is SequenceClassifierOutput for c in chunks)
    assert_same(merge_outputs(chunks, "cpu"), SequenceClassifierOutput(logits=x))


class Cache:
    """Named as transformers' base class, defined elsewhere: an ordinary object, passed whole."""


def test_inputs_holding_a_transformers_cache_run_once_on_the_root():
    """``past_key_values=DynamicCache(...)`` passed whole to every replica would collect every shard's keys and values
    in the one object: the inputs are not split (:func:`split_or_run_once` says run once), and ``DataParallelModel``
    runs the model once, unsplit, as one device does. A class merely named ``Cache`` is passed whole."""
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache

    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, attn_pdrop=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 50, (5, 8), generator=torch.Generator().manual_seed(0))

    kwargs = {"input_ids": ids, "past_key_values": DynamicCache()}
    roots = argument_roots((), kwargs)
    with pytest.raises(SharedStateError, match="DynamicCache"):
        split_arguments((), kwargs, CPU4)
    assert split_or_run_once(lambda: split_arguments((), kwargs, CPU4), roots) is None
    assert shared_state(roots) == "kwargs['past_key_values'] (DynamicCache)"
    assert len(split_arguments((ids, Cache()), {}, CPU4)[2]) == 4  # no transformers class in its MRO

    def two_calls(run):  # the second call attends to the keys and values the first one cached
        cache = DynamicCache()
        first = run(input_ids=ids[:, :5], past_key_values=cache)
        rest = run(input_ids=ids[:, 5:], past_key_values=cache)
        return torch.cat([first.logits, rest.logits], dim=1)

    expected = two_calls(model)
    dp_model = DataParallelModel(model, CPU4)
    got = two_calls(lambda **kw: dp_model(**kw)[0])
    assert dp_model.last_split_sizes == ()  # run once, unsplit
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


def test_an_array_without_the_sample_dimension_first_is_concatenated_with_a_warning():
    """An LSTM's ``(layers, batch, hidden)`` state on even shards: dim 0 holds no samples on any device, so the
    concatenation (nn.DataParallel's) is not one device's state; said, naming the output and the fix."""
    states = [torch.zeros(2, 3, 6) for _ in range(3)]
    with pytest.warns(
        UserWarning, match=r"output\[1\]: every device's array has as many entries along dim 0.*transpose"
    ):
        merged = merge_outputs([(torch.zeros(3, 1), s) for s in states], "cpu", sizes=[3, 3, 3])
    assert merged[1].shape == (6, 3, 6)


def test_a_statistic_of_each_shard_is_concatenated_with_a_warning_that_names_the_fix():
    """``logits.mean(0)`` returned from a step: one row per device, concatenated; the warning says to return
    per-sample rows and reduce them where the hook runs (found by a review: it named only LSTM states)."""
    with pytest.warns(UserWarning, match=r"a statistic of the batch \(x\.mean\(0\).*per-sample rows"):
        merged = merge_outputs([{"mean": torch.zeros(3)} for _ in range(2)], "cpu", sizes=[4, 4])
    assert merged["mean"].shape == (6,)


def test_samples_flattened_with_time_concatenate_without_a_word():
    """A language model's ``(batch * time, vocab)`` logits: the same multiple of every device's count, one device's
    result once concatenated (Lightning's demo Transformer under dp warned at every shard size)."""
    logits = [torch.randn(3 * 30, 5) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = merge_outputs(logits, "cpu", sizes=[3, 3])
    torch.testing.assert_close(merged, torch.cat(logits))


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([["id0"], ["id3"]], ["id0", "id3"]),  # ids of the selected samples, as many on each device by chance
        ([[], ["id0", "id3"]], ["id0", "id3"]),
        ([["loss", "acc"], ["loss", "acc"]], ["loss", "acc"]),  # names every device returns alike: a structure
    ],
)
def test_lists_of_strings_are_rows_unless_every_device_returns_the_same(ids, expected):
    merged = merge_outputs([{"ids": i} for i in ids], "cpu", sizes=[3, 3])
    assert merged == {"ids": expected}


def test_a_batch_of_batches_of_different_sizes_is_refused_with_the_fixes_for_several_dataloaders():
    """A CombinedLoader's ``{"a": (x, y), "b": (x, y)}`` with parts of 6 and 2 samples: the message names the parts and
    the fixes (equal batch sizes with drop_last, or dp), not a class weight or PerSample."""
    batch = {"a": (torch.randn(6, 4), torch.arange(6)), "b": (torch.randn(2, 4), torch.arange(2))}
    pattern = r"parts are batches of different sizes \(batch\['a'\] 6, batch\['b'\] 2\).*drop_last=True.*'dp'"
    with pytest.raises(lightning_mgpu.BatchSplitError, match=pattern) as info:
        split_batch(batch, ["cpu"] * 2)
    assert "PerSample" not in str(info.value) and "class weights" not in str(info.value)


class Targets:
    """Labels held as an attribute of a plain object, which the split does not open."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels


@dataclasses.dataclass
class TargetsRecord:
    labels: torch.Tensor


def test_parts_that_may_be_per_sample_but_go_whole_are_named_once_and_the_fix_splits_them():
    """An object holding the batch's labels, or 1-D labels with ``dim=1``, goes whole to every device (torch's shape
    error followed): each is named in a warning with the fix, which splits it; plain per-batch values say nothing."""
    x, y = torch.randn(7, 4), torch.arange(7)
    with pytest.warns(UserWarning, match=r"batch\[1\] is an object \(Targets\) holding tensors of 7 along dim 0"):
        split_batch((x, Targets(y)), ["cpu"] * 2)
    chunks, _ = split_batch((x, TargetsRecord(y)), ["cpu"] * 2)
    assert torch.equal(chunks[0][1].labels, y[:4])  # the fix: a dataclass is opened and split
    with pytest.warns(UserWarning, match=r"batch\[1\] has no dimension 1 to split: every device gets it whole"):
        split_batch((torch.randn(5, 7, 4), y), ["cpu"] * 2, dim=1)
    chunks, _ = split_batch((torch.randn(5, 7, 4), y.unsqueeze(0)), ["cpu"] * 2, dim=1)
    assert torch.equal(chunks[1][1], y.unsqueeze(0)[:, 4:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_batch({"x": x, "t": torch.tensor(2.0), "name": "run", "step": 3, "none": None}, ["cpu"] * 2)
        split_batch({"x": torch.randn(2, 12), "bias": torch.ones(3)}, ["cpu"] * 2, dim=1)  # not as long as the batch


def test_rows_of_varying_length_per_device_are_concatenated_without_a_warning():
    """An MLM head's masked-token rows (32 and 51 on shards of 16): per-sample data, one device's rows in order."""
    rows = [torch.randn(32, 5), torch.randn(51, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = merge_outputs(rows, "cpu", sizes=[16, 16])
    assert torch.equal(merged, torch.cat(rows))


# --- the DataLoader's sample count (``samples=``): per-sample items split by item -------------------------------------
def simclr_pairs(n: int, channels: int = 3, labels: bool = True) -> list:
    """A collate_fn's per-sample items as they are: ``((view1, view2), label)`` (lightning-bolts-style SimCLR)."""
    g = torch.Generator().manual_seed(n)
    views = [(torch.randn(channels, 8, 8, generator=g), torch.randn(channels, 8, 8, generator=g)) for _ in range(n)]
    return [(v, i) for i, v in enumerate(views)] if labels else views


@pytest.mark.parametrize(
    ("n", "samples", "devices", "expected"),
    [
        (5, (5,), 2, [3, 2]),  # a full batch
        (4, (4,), 2, [2, 2]),
        (3, (3,), 2, [2, 1]),  # as many samples as channels: the labels (numbers) say they are samples
        (2, (4, 2), 3, [1, 1]),  # the last batch of a DataLoader of 10 by 4
        (7, (7,), 3, [3, 2, 2]),
    ],
)
def test_per_sample_items_as_long_as_the_loader_batch_are_split_by_item(n, samples, devices, expected):
    batch = simclr_pairs(n)
    chunks, sizes = split_batch(batch, ["cpu"] * devices, samples=samples)
    assert sizes == expected
    assert all(type(chunk) is list for chunk in chunks)
    assert_same([item for chunk in chunks for item in chunk], batch)  # every image whole, in order


def test_per_sample_items_split_by_item_in_a_structure_and_through_call_arguments():
    pairs = simclr_pairs(5)
    chunks, sizes = split_batch({"pairs": tuple(pairs), "y": torch.arange(5)}, ["cpu"] * 2, samples=(5,))
    assert (
        sizes == [3, 2] and chunks[1]["pairs"] == tuple(pairs[3:]) and torch.equal(chunks[1]["y"], torch.arange(3, 5))
    )
    args, kwargs, sizes = split_arguments((pairs,), {"scale": 2.0}, ["cpu"] * 2, samples=(5,))
    assert sizes == [3, 2] and args[1][0] == pairs[3:] and kwargs[1] == {"scale": 2.0}


def test_zip_collated_detection_batches_split_by_item_with_the_loader_count():
    """``tuple(zip(*samples))`` (torchvision's detection collate): per-field tuples of per-sample items, each split by
    item, also when a target holds as many boxes as the batch has samples."""
    images = tuple(torch.randn(3, 6 + i, 5) for i in range(4))
    targets = tuple({"boxes": torch.randn(k, 4), "labels": torch.arange(k)} for k in (1, 4, 2, 3))
    chunks, sizes = split_batch((images, targets), ["cpu"] * 2, samples=(4,))
    assert sizes == [2, 2] and type(chunks[0]) is tuple and type(chunks[0][0]) is tuple
    assert_same(chunks[1], (images[2:], targets[2:]))


@pytest.mark.parametrize(
    "batch",
    [
        [[torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)], torch.arange(4)],  # default_collate's SimCLR batch
        (torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)),  # two stacked views, no labels
        [torch.randn(4, 2), torch.randn(4, 2)],
        (torch.randn(4, 6), torch.randint(0, 3, (4,))),
    ],
)
def test_batches_collated_along_dim_0_are_split_as_before_under_any_loader_count(batch):
    """A full batch of 4 from a DataLoader whose last batch holds 2: its two stacked views are no last batch of two
    samples (split by item, each device would get one view of every sample)."""
    expected, _ = split_batch(batch, ["cpu"] * 2)
    for samples in [(4,), (4, 2)]:
        chunks, sizes = split_batch(batch, ["cpu"] * 2, samples=samples)
        assert sizes == [2, 2]
        for chunk, chunk_before in zip(chunks, expected, strict=True):
            assert_same(chunk, chunk_before)


def test_lists_split_as_before_where_the_loader_count_says_nothing():
    """Items of several outlines, lists of plain ids and a coincidence the labels do not settle keep today's split."""
    mixed = [torch.randn(3, 8, 8), torch.randn(3, 4), 3]  # three fields, not three samples
    chunks, sizes = split_batch(mixed, ["cpu"] * 2, samples=(3,))
    assert sizes == [2, 1] and chunks[0][0].shape == (2, 8, 8) and chunks[0][2] == 3
    ids = ["a", "b", "c", "d"]
    chunks, _ = split_batch((torch.zeros(4, 2), ids), ["cpu"] * 2, samples=(4,))
    assert [c[1] for c in chunks] == [["a", "b"], ["c", "d"]]
    # Unlabelled views with as many channels as samples: nothing tells them from a collated batch (mark PerSample).
    chunks, sizes = split_batch(simclr_pairs(3, labels=False), ["cpu"] * 2, samples=(3,))
    assert chunks[0][0][0].shape == (2, 8, 8)
    chunks, sizes = split_batch(lightning_mgpu.PerSample(simclr_pairs(3, labels=False)), ["cpu"] * 2, samples=(3,))
    assert sizes == [2, 1] and chunks[0][0][0].shape == (3, 8, 8)


def test_a_tensor_beside_per_sample_items_that_disagrees_with_the_loader_count_is_refused_naming_both():
    batch = (simclr_pairs(5), torch.ones(3))  # class weights travelling in the batch
    with pytest.raises(BatchSplitError) as info:
        split_batch(batch, ["cpu"] * 2, samples=(5,))
    message = str(info.value)
    assert "batch[0] is a list of 5 tuples, one per sample of the DataLoader's batch (5 samples), so it is split " in (
        message
    )
    assert (
        "but batch[1] has size 3 along dim 0" in message and "keep what is not per sample out of the batch" in message
    )
    with pytest.raises(BatchSplitError, match=r"batch\[1\] has 4 items \(a PerSample\) along dim 0"):
        split_batch((simclr_pairs(5), lightning_mgpu.PerSample(range(4))), ["cpu"] * 2, samples=(5,))


def test_a_list_of_items_not_as_long_as_the_loader_batch_beside_its_tensors_is_refused_naming_it_and_the_fix():
    batch = (torch.arange(5), simclr_pairs(4))  # a collate_fn that lost a sample's pair
    with pytest.raises(BatchSplitError) as info:
        split_batch(batch, ["cpu"] * 2, samples=(5,))
    message = str(info.value)
    assert "batch[1] is a list of 4 tuples, but the DataLoader's batch holds 5 samples (batch[0] has 5)" in message
    assert "Return every sample's item from your collate_fn (5 of them)" in message
    with pytest.raises(BatchSplitError) as info:  # without the count: the message of before
        split_batch(batch, ["cpu"] * 2)
    assert "DataLoader" not in str(info.value)


@pytest.mark.parametrize("samples", [(4,), ()])
def test_dim_1_labels_with_their_samples_on_dim_0_are_told_where_they_are_and_how_to_move_them(samples):
    """``(T, B, F)`` inputs with ``(B, 1)`` labels under ``dim=1``: the labels' samples are on dim 0 (the advice of
    before, to keep them out of the split, would give every device all of them); the fix given splits them."""
    x, y = torch.randn(7, 4, 5), torch.arange(4.0).unsqueeze(1)
    with pytest.raises(BatchSplitError) as info:
        split_batch((x, y), ["cpu"] * 2, dim=1, samples=samples)
    message = str(info.value)
    assert "batch[1] has shape (4, 1): its 4 samples are on dim 0, not on dim 1, which the batch is split along " in (
        message
    )
    assert "`.movedim(0, 1)` (shape (1, 4)), and back in the step, `.movedim(1, 0)`" in message
    assert "keep it out of what is split" not in message
    chunks, sizes = split_batch((x, y.movedim(0, 1)), ["cpu"] * 2, dim=1, samples=samples)
    assert sizes == [2, 2] and torch.equal(chunks[1][1].movedim(1, 0), y[2:])


@pytest.mark.parametrize("samples", [(), (10, 4)])
@pytest.mark.parametrize("kind", ["tensor", "tuple", "list", "dict"])
def test_flat_batches_split_into_their_own_rows_on_every_device(kind, samples):
    """The common batch (tensors, or a flat list, tuple or dict of them) keeps its type, its keys' order and each
    device's own rows: 10 samples over 3 devices are rows 0-3, 4-6 and 7-9 of every part."""
    x, y = torch.arange(40.0).view(10, 4), torch.arange(10)
    batch = {"tensor": x, "tuple": (x, y), "list": [x, y], "dict": {"y": y, "x": x}}[kind]
    chunks, sizes = split_batch(batch, ["cpu"] * 3, samples=samples)
    assert sizes == [4, 3, 3]
    rows = [torch.arange(0, 4), torch.arange(4, 7), torch.arange(7, 10)]
    for chunk, index in zip(chunks, rows, strict=True):
        assert type(chunk) is type(batch)
        parts = [chunk] if kind == "tensor" else list(chunk.values()) if kind == "dict" else chunk
        whole = [x] if kind == "tensor" else [y, x] if kind == "dict" else [x, y]
        if kind == "dict":
            assert list(chunk) == ["y", "x"]
        assert all(torch.equal(part, full[index]) for part, full in zip(parts, whole, strict=True))


def test_a_flat_batch_whose_parts_disagree_is_refused_with_both_sizes():
    with pytest.raises(BatchSplitError, match=r"batch\[0\] has size 10 but batch\[1\] has size 9"):
        split_batch((torch.zeros(10, 2), torch.zeros(9)), ["cpu"] * 2)
