"""Misuse gives a clear error naming what is wrong."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import (
    BatchSplitError,
    DataParallelCriterion,
    DataParallelModel,
    merge_outputs,
    reduce_losses,
    run_replicas,
    split_batch,
)
from lightning_mgpu.parallel.devices import resolve_devices
from lightning_mgpu.parallel.scatter_gather import batch_size_of, split_sizes

CPU2 = ["cpu"] * 2
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")


def test_empty_batch():
    with pytest.raises(BatchSplitError, match="empty batch"):
        DataParallelModel(nn.Linear(3, 2), CPU2)(torch.zeros(0, 3))
    with pytest.raises(BatchSplitError, match="empty batch"):
        split_sizes(0, 4)
    with pytest.raises(BatchSplitError, match="no tensor"):
        split_batch({"names": ["a", "b"]}, CPU2)


def test_batch_sizes_disagree_names_the_key_path():
    batch = {"x": torch.zeros(4, 3), "mask": torch.zeros(3)}
    with pytest.raises(BatchSplitError, match=r"batch\['x'\] has size 4 but batch\['mask'\] has size 3"):
        split_batch(batch, CPU2)
    with pytest.raises(BatchSplitError, match=r"args\[0\]\['mask'\] has size 3"):
        DataParallelModel(nn.Identity(), CPU2)(batch)
    with pytest.raises(BatchSplitError, match=r"args\[0\] has size 4 but kwargs\['mask'\] has size 5"):
        DataParallelModel(nn.Identity(), CPU2)(torch.zeros(4, 3), mask=torch.zeros(5))
    with pytest.raises(BatchSplitError, match=r"batch\.left has size 2 but batch\.right"):
        from collections import namedtuple

        batch_size_of(namedtuple("P", "left right")(torch.zeros(2), torch.zeros(3)))


def test_a_tensor_that_is_not_per_sample_in_the_batch_is_refused_with_where_to_keep_it():
    batch = {"x": torch.zeros(5, 3), "y": torch.zeros(5), "class_weights": torch.ones(3)}
    with pytest.raises(BatchSplitError, match=r"class weights in the loss module.*`register_buffer`.*0-dim tensor"):
        split_batch(batch, CPU2)
    assert [c["class_weights"].shape for c in split_batch({**batch, "class_weights": torch.tensor(2.0)}, CPU2)[0]] == [
        torch.Size([]),
        torch.Size([]),
    ]


@pytest.mark.parametrize(
    ("device_ids", "error", "pattern"),
    [
        ([], ValueError, "device_ids is empty"),
        (["cud:0"], ValueError, "Invalid device string 'cud:0'"),
        (["cpu", "meta"], ValueError, "mixes device types"),
        ([-1], ValueError, "Invalid device index -1"),
        ([True], TypeError, "Invalid device True"),
        ([1.5], TypeError, "Invalid device 1.5"),
        ("cpu", TypeError, "wrap it in a list"),
    ],
)
def test_invalid_device_lists(device_ids, error, pattern):
    with pytest.raises(error, match=pattern):
        resolve_devices(device_ids)
    with pytest.raises(error, match=pattern):
        DataParallelModel(nn.Linear(2, 2), device_ids)
    with pytest.raises(error, match=pattern):
        DataParallelCriterion(nn.MSELoss(), device_ids)


@no_cuda
@pytest.mark.parametrize("device_ids", [["cuda:0"], [0, 1], ["cuda"]])
def test_cuda_devices_without_cuda(device_ids):
    with pytest.raises(ValueError, match="CUDA is not available"):
        DataParallelModel(nn.Linear(2, 2), device_ids)


def test_module_not_on_root_device():
    with pytest.raises(ValueError, match=r"root device meta .*'weight' is on cpu"):
        DataParallelModel(nn.Linear(2, 2), ["meta", "meta"])


def test_unknown_mode():
    with pytest.raises(ValueError, match="Unknown execution mode 'fast'"):
        DataParallelModel(nn.Linear(2, 2), CPU2, execution_mode="fast")


def test_criterion_outputs_and_targets_do_not_line_up():
    outputs = DataParallelModel(nn.Linear(3, 2), CPU2)(torch.zeros(8, 3))
    criterion = DataParallelCriterion(nn.MSELoss(), CPU2)
    with pytest.raises(ValueError, match=r"do not line up: .* tensors have size 10\. .*outputs hold \[4, 4\] samples"):
        criterion(outputs, torch.zeros(10, 2))
    with pytest.raises(BatchSplitError, match=r"targets\[0\] has size 8 but targets\[1\] has size 7"):
        criterion(outputs, torch.zeros(8, 2), torch.zeros(7))
    # Outputs whose own batch sizes cannot be read: the per-device check still catches a mismatch.
    # An output whose batch size cannot be read: the targets are split evenly and each device is checked.
    mixed = [torch.zeros(2, 2), (torch.zeros(3, 2), torch.zeros(4, 2))]
    with pytest.raises(ValueError, match=r"do not line up on device 0: the output has 2 samples .* targets have 3"):
        DataParallelCriterion(lambda *args: args[0].sum(), CPU2)(mixed, torch.zeros(5, 1))
    # No targets and no readable batch size: a loss whose record says its normalisation (a sum) needs no weights...
    weird = [(torch.ones(3, 2), torch.zeros(4, 2)), (2 * torch.ones(3, 2), torch.zeros(4, 2))]
    assert DataParallelCriterion(lambda a, b: a.sum(), CPU2)(weird).item() == 18.0
    # ...one whose record says nothing has unknown replica weights: weight_fn is the way out.
    with pytest.raises(ValueError, match="weight_fn"):
        DataParallelCriterion(lambda a, b: torch.tensor(float(a.sum())), CPU2)(weird)
    assert DataParallelCriterion(lambda a, b: a.sum() + 1, CPU2, weight_fn=lambda o, t: 1)(weird).item() == 10.0


@pytest.mark.parametrize("batch", [8, 7])
def test_a_teachers_per_device_outputs_as_targets_get_the_gather_that_works(batch):
    """Distillation with two DataParallelModels: the teacher's per-device list as the target is named, with the fix
    (``teacher.gather``), which equals one device."""
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 3).double(), nn.Linear(4, 3).double()
    parallel_student, parallel_teacher = DataParallelModel(student, CPU2), DataParallelModel(teacher, CPU2)
    criterion = DataParallelCriterion(nn.MSELoss(), CPU2)
    x = torch.randn(batch, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"targets\[0\] is a list of one tensor per device.*teacher\.gather\("):
        criterion(parallel_student(x), parallel_teacher(x))
    loss = criterion(parallel_student(x), parallel_teacher.gather(parallel_teacher(x)).detach())
    torch.testing.assert_close(loss, nn.functional.mse_loss(student(x), teacher(x)), rtol=0, atol=1e-15)


def test_criterion_given_a_tensor_or_tuple_instead_of_the_list():
    criterion = DataParallelCriterion(nn.MSELoss(), CPU2)
    with pytest.raises(TypeError, match=r"expects the list of per-device outputs .* got Tensor"):
        criterion(torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(TypeError, match="A tuple is taken as one model output"):
        criterion((torch.zeros(4, 2), torch.zeros(4, 2)), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="empty list of outputs"):
        criterion([], torch.zeros(4, 2))
    with pytest.raises(ValueError, match="outputs from 3 devices but the criterion has 2 device_ids"):
        criterion([torch.zeros(1, 2)] * 3, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="criterion must be callable"):
        DataParallelCriterion("mse", CPU2)


def test_a_criterion_that_takes_a_tuple_output_whole_is_told_how_tuples_are_passed():
    class WithAux(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.square().mean()

    def criterion(output, target):  # written for the whole (logits, aux) tuple
        return nn.functional.mse_loss(output[0], target) + output[1]

    outputs = DataParallelModel(WithAux(), CPU2)(torch.randn(6, 2))
    with pytest.raises(TypeError, match="takes 2 positional arguments") as caught:
        DataParallelCriterion(criterion, CPU2)(outputs, torch.zeros(6, 2))
    note = "\n".join(caught.value.__notes__)
    assert "passes each item of a tuple output as its own argument" in note and "2 items" in note
    # The fix the note gives works: the items as separate parameters.
    fixed = DataParallelCriterion(lambda logits, aux, target: nn.functional.mse_loss(logits, target) + aux, CPU2)
    whole = WithAux()(torch.cat([o[0] for o in outputs]))
    expected = nn.functional.mse_loss(whole[0], torch.zeros(6, 2)) + whole[1]
    torch.testing.assert_close(fixed(outputs, torch.zeros(6, 2)), expected)


def test_reduce_losses_errors():
    with pytest.raises(ValueError, match="only scalar losses"):
        reduce_losses([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(TypeError, match="loss of replica 0 is a float"):
        reduce_losses([1.0, torch.tensor(1.0)])
    with pytest.raises(ValueError, match="Every replica has loss weight 0"):
        reduce_losses([torch.tensor(1.0), torch.tensor(2.0)], [0, 0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        reduce_losses([torch.tensor(1.0), torch.tensor(2.0)], [1, -1])
    with pytest.raises(ValueError, match="finite and >= 0"):
        reduce_losses([torch.tensor(1.0), torch.tensor(2.0)], [1, float("nan")])
    with pytest.raises(ValueError, match="2 weights for 1 losses"):
        reduce_losses([torch.tensor(1.0)], [1, 2])
    with pytest.raises(ValueError, match="Unknown loss reduction"):
        reduce_losses([torch.tensor(1.0)], reduction="avg")
    with pytest.raises(ValueError, match="at least one loss"):
        reduce_losses([])


def test_merge_and_run_replicas_errors():
    with pytest.raises(ValueError, match="at least one output"):
        merge_outputs([], "cpu")
    with pytest.raises(ValueError, match=r"Cannot merge output\['b'\]"):
        merge_outputs([{"b": torch.zeros(1)}, {"b": [1]}], "cpu")
    with pytest.raises(
        ValueError,
        match=r"Cannot merge output\['a'\]: replica\(s\) \[1\] returned no value there, replica\(s\) \[0\] a value",
    ):
        merge_outputs([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "cpu")
    with pytest.raises(ValueError, match="2 functions for 3 devices"):
        run_replicas([lambda: 1, lambda: 2], ["cpu"] * 3)


def test_embeddings_whose_result_depends_on_the_split_are_named_once_at_wrapping():
    coupled = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Embedding(10, 4, max_norm=1.0))
    with pytest.warns(UserWarning, match=r"DataParallelModel: 0 \(scale_grad_by_freq=True\).*; 1 \(max_norm=1.0\)"):
        DataParallelModel(coupled, ["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallelModel(nn.Embedding(10, 4, padding_idx=0), ["cpu"] * 2)
        DataParallelModel(coupled, ["cpu"])  # one device: nothing is split
