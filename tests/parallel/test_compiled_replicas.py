"""Compiled modules (``module.compile()``, ``torch.compile(module)``) replicate: every replica runs compiled code
bound to its own tensors, with the original's compile options, and training equals the eager one-device run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, ReplicaSet

CPU3 = ["cpu"] * 3


class CountingBackend:
    """A torch.compile backend that runs the captured graph eagerly and counts how often compiled code runs."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)

        return run


class Net(nn.Module):
    """A user-defined module (dynamo skips torch.nn's own classes such as ``nn.Sequential`` as compile roots)."""

    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(6) if batchnorm else nn.Identity()
        self.layers = nn.Sequential(nn.Linear(4, 6), norm, nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def net(batchnorm: bool = True) -> Net:
    torch.manual_seed(0)
    return Net(batchnorm).double()


def _train(model: nn.Module, devices: list[str], steps: int = 3) -> list[torch.Tensor]:
    x = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (10,), generator=torch.Generator().manual_seed(2))
    wrapped = DataParallelModel(model, devices)
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), devices)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        criterion(wrapped(x), y).backward()
        optimizer.step()
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_compiled_replicas_run_their_own_compiled_code(how):
    backend = CountingBackend()
    eager = net()
    expected_replica0 = copy.deepcopy(eager)
    model = copy.deepcopy(eager)
    if how == "module.compile":
        model.compile(backend=backend)
        target = model
    else:
        target = nn.ModuleDict({"inner": torch.compile(model, backend=backend)})["inner"]
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outputs = DataParallelModel(target, CPU3)(x)
    assert backend.runs == 3  # each replica ran compiled code
    per_shard = torch.cat([copy.deepcopy(eager)(shard) for shard in x.tensor_split(3)])  # BatchNorm: shard statistics
    torch.testing.assert_close(torch.cat(outputs), per_shard, rtol=0, atol=1e-12)
    # BatchNorm running statistics come from replica 0's shard only: replica 0 ran on its own (shared) buffers,
    # and replicas 1 and 2 did not write into the original's buffers.
    expected_replica0(x[:3])
    torch.testing.assert_close(
        model.layers[1].running_mean, expected_replica0.layers[1].running_mean, rtol=0, atol=1e-12
    )
    assert model.layers[1].num_batches_tracked.item() == 1


def test_compiled_training_equals_eager_one_device():
    backend = CountingBackend()
    compiled = net(batchnorm=False)
    compiled.compile(backend=backend)
    got = _train(compiled, CPU3)
    expected = _train(net(batchnorm=False), ["cpu"])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert backend.runs >= 9  # 3 steps x 3 replicas


def test_compiling_after_the_build_rebuilds_the_replicas():
    model = net()
    replicas = ReplicaSet(model, CPU3)
    replicas.prepare()
    assert replicas.builds == 1 and not replicas.compiled
    backend = CountingBackend()
    model.compile(backend=backend)
    x = torch.randn(6, 4, dtype=torch.float64)
    for replica in replicas.prepare():
        replica(x[:2])
    assert replicas.builds == 2 and replicas.compiled and backend.runs == 3


def test_a_model_compiled_between_steps_runs_its_replicas_one_after_another_from_that_step_on():
    model = net(batchnorm=False)
    parallel = DataParallelModel(model, CPU3, execution_mode="threads")
    x = torch.randn(6, 4, dtype=torch.float64)
    parallel(x)
    backend = CountingBackend()
    model.compile(backend=backend)
    with pytest.warns(UserWarning, match="execution_mode='threads' overridden: the model is compiled"):
        outputs = parallel(x)  # the mode is chosen after the structure check that sees the compilation
    torch.testing.assert_close(torch.cat(outputs), net(batchnorm=False)(x), rtol=0, atol=1e-12)
    assert backend.runs == 3
