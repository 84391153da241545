"""Issue 12, pure-PyTorch core: behave like the references (``torch.nn.DataParallel``, torch's own tests) on every
input they accept, for the whole class of input behind each reported case.

Reference behaviour, read from ``torch/nn/parallel/data_parallel.py`` and ``scatter_gather.py`` (``nn.DataParallel``
is a pass-through without CUDA, so it cannot run its multi-device path here):

* ``DataParallel.forward`` with no inputs sets ``inputs = ((),)`` and runs the module once, on ``device_ids[0]``;
* ``scatter`` never fails on values that are not tensors: it hands them whole to every replica;
* ``test_data_parallel.py::test_data_parallel_model_no_refcycles`` expects ``gc.collect() == 0`` after one call.

Threads-mode tests run under :func:`finishes_within`, so a hang fails the test instead of the run.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_mgpu import (
    BatchSplitError,
    DataParallelCriterion,
    DataParallelModel,
    PerSample,
    merge_outputs,
    reduce_losses,
)

MODES = ["threads", "sequential"]
F64 = torch.float64


def finishes_within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a helper thread; fails the test if it has not returned after ``seconds`` (a hang)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # KeyboardInterrupt too: the test inspects it
            box["error"] = err

    worker = threading.Thread(target=target, daemon=True, name="reference-behaviour-test")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"did not finish within {seconds} s: a replica or the caller hangs")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def dpm(module: nn.Module, n: int = 2, mode: str = "sequential") -> DataParallelModel:
    return DataParallelModel(module, device_ids=["cpu"] * n, execution_mode=mode)


def dpc(criterion: Any, n: int = 2, mode: str = "sequential", **kwargs: Any) -> DataParallelCriterion:
    return DataParallelCriterion(criterion, device_ids=["cpu"] * n, execution_mode=mode, **kwargs)


class Recorder(nn.Module):
    """Returns ``2 * w`` whatever its inputs, and records every call's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=F64))
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        self.calls.append((args, kwargs))
        return self.w * 2


class Lengths(nn.Module):
    """Per-sample output from a list of strings: ``len(text) * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5, dtype=F64))
        self.seen: list[list[str]] = []

    def forward(self, texts: list[str]) -> Tensor:
        self.seen.append(list(texts))
        return torch.tensor([float(len(t)) for t in texts], dtype=F64) * self.w


# --- item 1: inputs with no batch tensor -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_forward_without_inputs_runs_once_on_the_root_as_nn_DataParallel_does(mode):
    module = Recorder()
    model = dpm(module, 2, mode)
    outputs = finishes_within(30, model)
    assert module.calls == [((), {})]  # once, with no arguments, like DataParallel's inputs = ((),)
    assert len(outputs) == 1 and torch.equal(outputs[0], torch.tensor([2.0, -4.0, 6.0], dtype=F64))
    assert model.last_split_sizes == ()
    assert torch.equal(outputs[0], nn.DataParallel(Recorder())())  # the reference, a pass-through on CPU
    outputs[0].sum().backward()
    assert torch.equal(module.w.grad, torch.full((3,), 2.0, dtype=F64))
    assert torch.equal(model.gather(outputs), outputs[0])


ZERO_DIM = torch.tensor(2.5)
PLAIN_INPUTS = [
    pytest.param((1,), {}, id="int"),
    pytest.param((), {"x": 2.0}, id="float-kwarg"),
    pytest.param(({"x": 1},), {}, id="dict-of-int"),
    pytest.param(([1, 2, 3],), {}, id="list-of-ints"),
    pytest.param(((3, 4),), {"size": (16, 16)}, id="tuples-of-ints"),
    pytest.param((None,), {"flag": True}, id="none-and-bool"),
    pytest.param((ZERO_DIM,), {}, id="0-dim-tensor"),
    pytest.param((), {"mode": "eval"}, id="string-kwarg"),
    pytest.param(
        ("eval",),
        {},
        id="string-arg",
    ),
    pytest.param(
        ("en", "fr"),
        {},
        id="two-string-args",
    ),
]


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types, containers included (tensors compared by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(("args", "kwargs"), PLAIN_INPUTS)
def test_plain_values_run_once_on_the_root_with_the_values_untouched(args, kwargs):
    module = Recorder()
    outputs = dpm(module, 2)(*args, **kwargs)
    assert len(module.calls) == 1
    (seen_args, seen_kwargs) = module.calls[0]
    assert _same(seen_args, args) and _same(seen_kwargs, kwargs)
    assert len(outputs) == 1 and torch.equal(outputs[0], module.w * 2)
    # The one output feeds the criterion like one device's (a plain call).
    loss = dpc(nn.MSELoss(), 2)(outputs, torch.zeros(3, dtype=F64))
    assert torch.equal(loss, nn.functional.mse_loss(module.w * 2, torch.zeros(3, dtype=F64)))


STRING_SEQUENCES = [
    pytest.param((["a", "b"],), {}, id="list-arg"),
    pytest.param((("a", "b", "c"),), {}, id="tuple-arg"),
    pytest.param((), {"texts": ["a", "b"]}, id="list-kwarg"),
    pytest.param(({"text": ["a", "b", "c"], "lang": "en"},), {}, id="nested-in-dict"),
]


@pytest.mark.parametrize(("args", "kwargs"), STRING_SEQUENCES)
@pytest.mark.parametrize("n", [2, 3])
def test_string_sequences_without_a_tensor_ask_for_PerSample(args, kwargs, n):
    module = Recorder()
    with pytest.raises(BatchSplitError, match=r"sequence of \d strings[\s\S]*lightning_mgpu\.PerSample\(\.\.\.\)"):
        dpm(module, n)(*args, **kwargs)
    assert module.calls == []


@pytest.mark.parametrize(
    ("args", "kwargs", "where"),
    [((["a", "b"],), {}, "args[0]"), ((), {"texts": ["a", "b"]}, "kwargs['texts']")],
)
def test_the_PerSample_error_names_the_argument_as_other_split_errors_do(args, kwargs, where):
    with pytest.raises(BatchSplitError) as info:
        dpm(Recorder(), 2)(*args, **kwargs)
    assert f"only {where}," in str(info.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("n", "chunks"), [(2, [["a", "bb", "ccc"], ["dddd", "e"]]), (3, [["a", "bb"], ["ccc", "dddd"], ["e"]])]
)
def test_PerSample_strings_are_split_by_item_and_gathered_in_order(mode, n, chunks):
    texts = PerSample(["a", "bb", "ccc", "dddd", "e"])
    single = Lengths()
    expected = single(list(texts))
    expected.sum().backward()
    module = Lengths()
    model = dpm(module, n, mode)
    outputs = finishes_within(30, lambda: model(texts))
    assert sorted(module.seen) == chunks  # threads may run the replicas in any order
    assert model.last_split_sizes == tuple(len(c) for c in chunks)
    gathered = model.gather(outputs)
    assert torch.equal(gathered, expected)
    gathered.sum().backward()
    assert torch.equal(module.w.grad, single.w.grad)


# --- item 2: no reference cycle per replicated call ---------------------------------------------------------------
class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Sequential(nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.bn(self.a(x)))


class GcDisabled:
    """Automatic collection off, so cycles made by the code under test stay for gc.collect() to count."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was_enabled:
            gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_one_replicated_call_leaves_no_reference_cycle(mode):
    """torch's test_data_parallel_model_no_refcycles, with backward, buffers and deletion of the model."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, dtype=F64), torch.randn(6, 2, dtype=F64)

    def run() -> list[int]:
        counts = []
        with GcDisabled():
            model = dpm(WithBuffers().double(), 2, mode)
            criterion = dpc(nn.MSELoss(), 2, mode)
            outputs = model(x)
            counts.append(gc.collect())
            loss = criterion(outputs, y)
            loss.backward()
            counts.append(gc.collect())
            del model, criterion, outputs, loss  # replicas and buffer copies must go by reference counting
            counts.append(gc.collect())
        return counts

    run()  # torch imports modules lazily on a first call (broadcast_shapes: sympy), whose classes gc collects
    assert finishes_within(60, run) == [0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_no_object_growth_over_50_steps(mode):
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, dtype=F64), torch.randn(6, 2, dtype=F64)
    net = WithBuffers().double()
    model, criterion = dpm(net, 3, mode), dpc(nn.MSELoss(), 3, mode)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()

    def run() -> tuple[int, int]:
        with GcDisabled():
            for _ in range(10):
                step()
            before = len(gc.get_objects())
            for _ in range(40):
                step()
            return before, len(gc.get_objects())

    before, after = finishes_within(120, run)
    assert after == before


# --- item 3: reduce_losses' equal-weight and sum modes on integer and half-precision losses -----------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize(("reduction", "expected"), [("replica_mean", 2.5), ("sum", 10.0)])
def test_integer_losses_are_reduced_in_float32(dtype, reduction, expected):
    losses = [torch.tensor(v, dtype=dtype) for v in (1, 2, 3, 4)]
    result = reduce_losses(losses, reduction=reduction)
    assert result.dtype == torch.float32 and result.item() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("reduction", "values", "expected"),
    [
        # (1 + 1.0078125) / 2 = 1.00390625: exact in float32, rounds to 1.0 in bfloat16.
        ("replica_mean", (1.0, 1.0078125), 1.00390625),
        # 256 + 1.0078125 + 1 = 258.0078125: exact in float32, rounds to 258 in bfloat16 and float16.
        ("sum", (256.0, 1.0078125, 1.0), 258.0078125),
    ],
)
def test_half_precision_losses_are_reduced_in_float32_and_keep_their_gradients(dtype, reduction, values, expected):
    losses = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in values]
    result = reduce_losses(losses, reduction=reduction)
    assert result.dtype == torch.float32 and result.item() == expected
    result.backward()
    scale = 1.0 / len(values) if reduction == "replica_mean" else 1.0
    assert all(loss.grad.dtype == dtype and loss.grad.item() == scale for loss in losses)


@pytest.mark.parametrize("mode", MODES)
def test_criterion_sum_of_bfloat16_losses_is_exact(mode):
    """DataParallelCriterion's "sum" path: replica sums of 256 and 1.0078125 (each exact in bfloat16) add up to
    257.0078125 in float32, where bfloat16 would round to 256."""
    outputs = [torch.tensor([128.0, 128.0], dtype=torch.bfloat16), torch.tensor([1.0078125, 0.0], dtype=torch.bfloat16)]
    targets = torch.zeros(4, dtype=torch.bfloat16)
    loss = finishes_within(30, lambda: dpc(nn.L1Loss(reduction="sum"), 2, mode)(outputs, targets))
    assert loss.dtype == torch.float32 and loss.item() == 257.0078125


# --- item 4: merging replica results never drops data silently ----------------------------------------------------
T = torch.arange(4.0, dtype=F64).reshape(2, 2)


@dataclass
class Out:
    logits: Tensor
    aux: Tensor | None = None


Pair = namedtuple("Pair", ["logits", "aux"])


def _partial_error(path: str, absent_on: list[int]) -> str:
    return rf"Cannot merge {path}: replica\(s\) {re.escape(str(absent_on))} returned (None|no value) there"


NONE_ON_SOME = [
    pytest.param([None, T], "output", [0], id="none-first"),
    pytest.param([T, None], "output", [1], id="none-second"),
    pytest.param([T, None, T], "output", [1], id="none-middle-of-3"),
    pytest.param([{"x": T, "aux": None}, {"x": T, "aux": T}], r"output\['aux'\]", [0], id="dict-value"),
    pytest.param([{"a": {"b": T}}, {"a": {"b": None}}], r"output\['a'\]\['b'\]", [1], id="nested-dict"),
    pytest.param([{"a": [T, None]}, {"a": [T, T]}], r"output\['a'\]\[1\]", [0], id="list-in-dict"),
    pytest.param([(T, None), (T, T)], r"output\[1\]", [0], id="tuple-item"),
    pytest.param([Pair(T, T), Pair(T, None)], r"output\.aux", [1], id="namedtuple-field"),
    pytest.param([Out(T, None), Out(T, T)], r"output\.aux", [0], id="dataclass-field"),
    pytest.param([{"x": T}, {"x": T, "aux": T}], r"output\['aux'\]", [0], id="key-on-others-only"),
    pytest.param([{"x": T, "aux": T}, {"x": T}], r"output\['aux'\]", [1], id="key-on-replica-0-only"),
    pytest.param([{"x": T, "aux": T}, {"x": T, "aux": T}, {"x": T}], r"output\['aux'\]", [2], id="key-missing-on-2"),
]


@pytest.mark.parametrize(("outputs", "path", "absent_on"), NONE_ON_SOME)
def test_values_on_some_replicas_only_are_an_error_naming_the_value_and_the_replicas(outputs, path, absent_on):
    with pytest.raises(ValueError, match=_partial_error(path, absent_on)):
        merge_outputs(outputs, "cpu")


def test_model_output_with_an_optional_field_on_some_replicas_only():
    """transformers' ModelOutput leaves None fields out of its keys, so None on some replicas is a missing key."""
    outputs_module = pytest.importorskip("transformers.modeling_outputs")
    output = outputs_module.BaseModelOutput
    with pytest.raises(ValueError, match=r"Cannot merge output\['attentions'\]: replica\(s\) \[0\]"):
        merge_outputs([output(last_hidden_state=T), output(last_hidden_state=T, attentions=(T,))], "cpu")
    merged = merge_outputs([output(last_hidden_state=T), output(last_hidden_state=T + 1)], "cpu")
    assert type(merged) is output and merged.attentions is None
    assert torch.equal(merged.last_hidden_state, torch.cat([T, T + 1]))


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        pytest.param([None, None], None, id="none-everywhere"),
        pytest.param([{"aux": None}, {"aux": None}], {"aux": None}, id="none-value-everywhere"),
        pytest.param([(T, None), (T, None)], (torch.cat([T, T]), None), id="none-item-everywhere"),
        pytest.param([Out(T), Out(T)], Out(torch.cat([T, T])), id="dataclass-default-none"),
    ],
)
def test_none_on_every_replica_stays_none(outputs, expected):
    merged = merge_outputs(outputs, "cpu")
    if expected is None:
        assert merged is None
    elif isinstance(expected, Out):
        assert type(merged) is Out and merged.aux is None and torch.equal(merged.logits, expected.logits)
    elif isinstance(expected, dict):
        assert merged == expected
    else:
        assert type(merged) is tuple and merged[1] is None and torch.equal(merged[0], expected[0])


def test_none_items_of_per_sample_lists_are_kept_in_order():
    """None as one sample's value (a record without a label) is data, not a missing value: never dropped."""
    assert merge_outputs([["a", None], [None]], "cpu", sizes=[2, 1]) == ["a", None, None]
    assert merge_outputs([[None, 1], [2, None]], "cpu", sizes=[2, 2]) == [None, 1, 2, None]
    merged = merge_outputs([PerSample([T, None]), PerSample([None])], "cpu")
    assert isinstance(merged, PerSample) and len(merged) == 3 and merged[1] is None and merged[2] is None


class AuxOnSomeChunks(nn.Module):
    """Returns an ``aux`` entry only when its chunk starts with a negative value (so only on some replicas)."""

    def __init__(self, missing: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, dtype=F64))
        self.missing = missing

    def forward(self, x: Tensor) -> dict[str, Tensor | None]:
        out: dict[str, Tensor | None] = {"y": x * self.w}
        aux = x.sum().reshape(1) if x[0] < 0 else None
        if aux is not None or not self.missing:
            out["aux"] = aux
        return out


@pytest.mark.parametrize("missing", [False, True], ids=["aux-none", "aux-missing"])
@pytest.mark.parametrize("mode", MODES)
def test_DataParallelModel_gather_names_values_present_on_some_replicas_only(mode, missing):
    model = dpm(AuxOnSomeChunks(missing), 2, mode)
    outputs = finishes_within(30, lambda: model(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=F64)))
    with pytest.raises(ValueError, match=r"Cannot merge output\['aux'\]: replica\(s\) \[0\]"):
        model.gather(outputs)


# --- item 5: threads mode is bitwise reproducible -----------------------------------------------------------------
class TiedLM(nn.Module):
    """Embedding and output projection share one weight (float32, where summation order changes the bits)."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Sequential(nn.Linear(width, 64), nn.Tanh(), nn.Linear(64, width))
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.mid(self.emb(ids)))


class TokenCrossEntropy(nn.Module):
    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _gradients(mode: str, steps: int) -> list[bytes]:
    torch.manual_seed(0)
    net = TiedLM()
    model, criterion = dpm(net, 4, mode), dpc(TokenCrossEntropy(), 4, mode)
    ids, target = torch.randint(0, 50, (64, 12)), torch.randint(0, 50, (64, 12))
    grads = []
    for _ in range(steps):
        net.zero_grad(set_to_none=True)
        criterion(model(ids), target).backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]).numpy().tobytes())
    return grads


def test_threads_mode_gives_one_gradient_bitwise_over_20_identical_steps():
    threads = finishes_within(120, lambda: _gradients("threads", 20))
    assert len(set(threads)) == 1
    sequential = _gradients("sequential", 3)
    assert len(set(sequential)) == 1  # bitwise reproducible too (another summation order: equal to rounding)
    torch.testing.assert_close(
        torch.frombuffer(bytearray(threads[0]), dtype=F64), torch.frombuffer(bytearray(sequential[0]), dtype=F64)
    )


# --- item 6: a BaseException in one replica waits for the others --------------------------------------------------
class InterruptsOnNegative(nn.Module):
    """The replica whose chunk starts with a negative value raises at once; the others take 0.3 s to finish."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, dtype=F64))
        self.error = error
        self.finished: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        if x[0] < 0:
            raise self.error
        time.sleep(0.3)
        self.finished.append(int(x[0]))
        return x * self.w


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_base_exception_in_a_replica_of_DataParallelModel_is_raised_after_the_others_finished(error):
    module = InterruptsOnNegative(error)
    model = dpm(module, 3, "threads")
    finished_when_raised: list[list[int]] = []

    def run() -> None:
        try:
            model(torch.tensor([-1.0, 2.0, 3.0], dtype=F64))
        except BaseException:
            finished_when_raised.append(sorted(module.finished))
            raise

    with pytest.raises(type(error)) as info:
        finishes_within(30, run)
    assert info.value is error and error.replica_index == 0
    assert finished_when_raised == [[2, 3]]
    assert not torch.nn.modules.module._global_buffer_registration_hooks  # the failed run ended with the call


# --- item 7: a replica's exception keeps its attributes, through the modules --------------------------------------
class Quota(Exception):
    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"{user} is over quota")
        self.user = user
        self.limit = limit


class RaisesOnNegative(nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, dtype=F64))
        self.error = error

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:
        if x[0] < 0:
            raise self.error
        return x * self.w


def _note(err: BaseException) -> str:
    notes = getattr(err, "__notes__", [])
    assert len(notes) == 1, notes
    return notes[0]


@pytest.mark.parametrize("mode", MODES)
def test_DataParallelModel_raises_the_replicas_own_exception_with_its_attributes(mode):
    error = FileNotFoundError(2, "No such file", "/data/x.bin")
    model = dpm(RaisesOnNegative(error), 2, mode)
    with pytest.raises(FileNotFoundError) as info:
        finishes_within(30, lambda: model(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=F64)))
    err = info.value
    assert err is error
    assert (err.errno, err.strerror, err.filename) == (2, "No such file", "/data/x.bin")
    assert err.replica_index == 1 and err.replica_device == torch.device("cpu")
    note = _note(err)
    assert note.startswith("Caught FileNotFoundError in replica 1 on device cpu.\nOriginal Traceback (most recent call")
    assert "in forward" in note  # the replica's own frames


@pytest.mark.parametrize("mode", MODES)
def test_DataParallelCriterion_raises_the_replicas_own_exception_with_its_fields(mode):
    def criterion(output: Tensor, target: Tensor) -> Tensor:
        if target[0] < 0:
            raise Quota("ada", 3)
        return (output - target).abs().mean()

    outputs = [torch.ones(2, dtype=F64), torch.ones(2, dtype=F64), torch.ones(1, dtype=F64)]
    with pytest.raises(Quota) as info:
        finishes_within(30, lambda: dpc(criterion, 3, mode)(outputs, torch.tensor([1.0, 2.0, 3.0, 4.0, -5.0])))
    err = info.value
    assert (err.user, err.limit, str(err)) == ("ada", 3, "ada is over quota")
    assert err.replica_index == 2
    assert _note(err).startswith("Caught Quota in replica 2 on device cpu.\nOriginal Traceback")


# --- item 8: messages ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "outputs",
    [pytest.param(T, id="tensor"), pytest.param({"x": T}, id="dict"), pytest.param("out", id="str")],
)
def test_merge_of_something_else_than_the_list_of_outputs_says_what_to_pass(outputs):
    expected = r"merge_outputs\(\) takes the list of per-replica outputs .*got a \w+\. Pass e\.g\."
    with pytest.raises(TypeError, match=expected):
        merge_outputs(outputs, "cpu")


@pytest.mark.parametrize("returned", [None, "3", torch.ones(2), True])
def test_weight_fn_returning_no_number_is_a_clear_error(returned):
    criterion = dpc(nn.MSELoss(), 2, weight_fn=lambda output, targets: returned)
    outputs = [torch.ones(2, dtype=F64), torch.ones(2, dtype=F64)]
    with pytest.raises(
        TypeError, match=r"(weight_fn returned|loss weight of replica 0 is) .*must (return|be) a number"
    ):
        criterion(outputs, torch.zeros(4, dtype=F64))


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.bad = bool((x < 0).any())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if ctx.bad:
            raise ValueError("bad gradient")
        return grad


class BackwardFailsOnNegative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return FailsInBackward.apply(x * self.w)


def test_anomaly_detection_names_the_replica_whose_backward_failed():
    """Autograd keeps no record of the replica; the forward traceback anomaly detection prints names it."""
    model = dpm(BackwardFailsOnNegative(), 2, "threads")

    def run() -> None:
        with torch.autograd.detect_anomaly():
            outputs = model(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=F64))
            torch.stack([o.sum() for o in outputs]).sum().backward()

    with (
        pytest.warns(UserWarning, match=r"Error detected in FailsInBackwardBackward[\s\S]*in replica_1\n"),
        pytest.raises(ValueError, match="bad gradient"),
    ):
        finishes_within(30, run)
