"""transformers' lazily installed output-capturing hooks are installed once, on the originals, not by each replica."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu import DataParallelModel

transformers = pytest.importorskip("transformers")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config).double()


def forward_hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_hidden_states_come_back_once_per_layer_and_the_model_keeps_its_own_hooks(mode):
    ids = torch.randint(0, 50, (5, 8), generator=torch.Generator().manual_seed(0))
    reference = gpt2()
    expected = reference(input_ids=ids, output_hidden_states=True).hidden_states  # embeddings + 2 layers
    hooks = forward_hook_count(reference)

    model = gpt2()
    parallel = DataParallelModel(model, ["cpu"] * 3, execution_mode=mode)
    for _ in range(2):
        outputs = parallel(input_ids=ids, output_hidden_states=True)
        assert [len(o.hidden_states) for o in outputs] == [len(expected)] * 3
        gathered = parallel.gather(outputs).hidden_states
        for got, want in zip(gathered, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert forward_hook_count(model) == hooks
    assert len(model(input_ids=ids, output_hidden_states=True).hidden_states) == len(expected)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_a_head_on_the_last_hidden_states_trains_as_on_one_device(strategy, tmp_path):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    class Head(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()
            self.head = torch.nn.Linear(16, 3, dtype=torch.float64)

        def training_step(self, batch, batch_idx):
            ids, y = batch
            hidden = self.model(input_ids=ids, output_hidden_states=True).hidden_states
            logits = self.head(torch.stack(hidden[-2:]).mean(0)[:, -1])
            return torch.nn.functional.cross_entropy(logits, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 50, (8,), generator=g), torch.tensor(i % 3)) for i in range(12)]
    weights = []
    for devices, name in [(1, "auto"), (2, strategy)]:
        module = Head()
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=name, max_epochs=1, logger=False,
                            default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(module, DataLoader(data, batch_size=6))
        weights.append(module.head.weight.detach().clone())
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-10)
