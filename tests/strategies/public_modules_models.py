# ruff: noqa: B905, RUF059  (the sources' code as they write it: zip() without strict=, unused unpacked names)
"""Tiny stand-ins for LightningModules as public repositories write them, for ``test_public_modules.py``.

Each class keeps its source's step as written (loss, logging, optimizer and scheduler, callbacks), made tiny: a few
channels, 8x8 images, a handful of samples. Where a source line cannot run in float64 on one device either (an
explicit ``.float()`` cast of the input), it is changed to the module's dtype and says so. Sources:

* ``LitResnet``: Lightning's "PyTorch Lightning CIFAR10 ~94% Baseline Tutorial" (torchvision's ResNet with a 3x3
  ``conv1`` and no max-pool, ``log_softmax`` + ``F.nll_loss``, torchmetrics' functional ``accuracy``, ``OneCycleLR``
  per step, ``LearningRateMonitor``);
* ``SegModel`` / ``UNet``: Lightning's ``domain_templates/semantic_segmentation.py`` (KITTI, ``ignore_index=250``) and
  its ``unet.py`` (``DoubleConv`` with BatchNorm, ``Down``, ``Up``);
* ``SimCLR``: lightning-bolts' ``SimCLR`` as written (``Projection`` head with BatchNorm1d, ``nt_xent_loss`` gathering
  through ``SyncFunction`` behind ``torch.distributed.is_initialized()``); ``SimCLRAllGather``: the same with the
  package docs' fix (``nt_xent_loss`` overridden to use ``self.all_gather(z, sync_grads=True)``);
* ``BarlowTwins``: Lightning's "Barlow Twins Tutorial" (``BarlowTwinsLoss`` on batch-standardised embeddings,
  ``ProjectionHead`` with BatchNorm1d, ``OnlineFineTuner`` callback), its embeddings gathered with ``self.all_gather``;
* ``DQNLightning``: Lightning's ``domain_templates/reinforce_learn_Qnet.py`` (``Agent``, ``ReplayBuffer``,
  ``RLDataset``, the target network copied every ``sync_rate`` steps in ``training_step``), on a gym-like ring walk;
* ``MoCoV2``: lightning-bolts' ``MoCoV2`` (momentum update through ``param_k.data = ...``, ``queue`` / ``queue_ptr``
  buffers, ``_dequeue_and_enqueue``, ``precision_at_k``), its ``concat_all_gather`` replaced by ``self.all_gather``;
* ``PairsClassifier``: a per-sample-pairs collate (``collate_fn`` returning the ``((v1, v2), label)`` items as
  they are);
* ``GAN``: Lightning's ``basic_gan.py`` (manual optimization, two Adam optimizers, ``BatchNorm1d(out, 0.8)`` in the
  generator), its noise drawn in the DataLoader;
* ``MNISTLitModule``: lightning-hydra-template's (``SimpleDenseNet`` with BatchNorm1d, ``MeanMetric`` of the loss,
  ``Accuracy``, ``MaxMetric`` of the best validation accuracy, ``ReduceLROnPlateau`` on ``val/loss``), with an F1 and
  metrics held in a plain dict attribute.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque, namedtuple
from functools import partial
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy
from torchmetrics.functional import accuracy

DTYPE = torch.float64
IMAGE = (3, 8, 8)


# --- data ------------------------------------------------------------------------------------------------------------
class Images(Dataset):
    """``n`` random images with labels (CIFAR-shaped, 8x8)."""

    def __init__(self, n: int, classes: int = 4, seed: int = 0, shape: tuple[int, ...] = IMAGE) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, *shape, generator=g, dtype=DTYPE)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]


class Views(Images):
    """SSL views of an image: ``((view1, view2[, view3]), label)``; a view is the image with noise and a flip."""

    def __init__(self, n: int, views: int = 2, seed: int = 0) -> None:
        super().__init__(n, seed=seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.noise = torch.randn(views, *self.x.shape, generator=g, dtype=DTYPE) * 0.3
        self.views = views

    def __getitem__(self, i: int) -> Any:
        views = tuple(
            (self.x[i] + self.noise[v, i]).flip(-1) if v % 2 else self.x[i] + self.noise[v, i]
            for v in range(self.views)
        )
        return views, self.y[i]


class Segmentation(Dataset):
    """KITTI-like: an image and a mask of class ids, 250 where the pixel is void; ``void`` samples are all 250."""

    def __init__(self, n: int, classes: int = 3, void: tuple[int, ...] = (), seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, *IMAGE, generator=g, dtype=DTYPE)
        self.mask = torch.randint(0, classes, (n, 8, 8), generator=g)
        self.mask[torch.rand(n, 8, 8, generator=g) < 0.3] = 250
        for i in void:
            self.mask[i] = 250

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.mask[i]


class WithNoise(Dataset):
    """MNIST-like images (here 1x4x4) with a label and the generator's noise ``z``, drawn here once for all runs."""

    def __init__(self, n: int, latent_dim: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 4, 4, generator=g, dtype=DTYPE).tanh()
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.z = torch.randn(n, latent_dim, generator=g, dtype=DTYPE)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i], self.z[i]


def per_sample_pairs(items: list[Any]) -> list[Any]:
    """A collate that returns the ``((view1, view2), label)`` items as they are."""
    return items


# --- 1a. Lightning's CIFAR10 baseline tutorial -----------------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` with one ``BasicBlock`` per stage and two stages, ``width`` channels."""

    def __init__(self, num_classes: int = 10, width: int = 4) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, 1)
        self.layer2 = self._make_layer(width * 2, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 2, num_classes)

    def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layer = nn.Sequential(BasicBlock(self.inplanes, planes, stride, downsample))
        self.inplanes = planes
        return layer

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def create_model() -> nn.Module:
    model = ResNet(num_classes=10)  # torchvision.models.resnet18(weights=None, num_classes=10)
    model.conv1 = nn.Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
    model.maxpool = nn.Identity()
    return model


class LitResnet(L.LightningModule):
    def __init__(self, lr: float = 0.05, batch_size: int = 5, train_size: int = 13) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model()

    def forward(self, x: Tensor) -> Tensor:
        out = self.model(x)
        return F.log_softmax(out, dim=1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        self.log("train_loss", loss)
        return loss

    def evaluate(self, batch: Any, stage: str | None = None) -> None:
        x, y = batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        preds = torch.argmax(logits, dim=1)
        acc = accuracy(preds, y, task="multiclass", num_classes=10)

        if stage:
            self.log(f"{stage}_loss", loss, prog_bar=True)
            self.log(f"{stage}_acc", acc, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        # The tutorial's 45000 // BATCH_SIZE undercounts a last partial batch; ceil keeps OneCycleLR in range.
        steps_per_epoch = math.ceil(self.hparams.train_size / self.hparams.batch_size)
        scheduler_dict = {
            "scheduler": torch.optim.lr_scheduler.OneCycleLR(
                optimizer, 0.1, epochs=self.trainer.max_epochs, steps_per_epoch=steps_per_epoch
            ),
            "interval": "step",
        }
        return {"optimizer": optimizer, "lr_scheduler": scheduler_dict}


# --- 1b. Lightning's semantic segmentation example -------------------------------------------------------------------
class DoubleConv(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Down(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.MaxPool2d(kernel_size=2, stride=2), DoubleConv(in_ch, out_ch))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Up(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, bilinear: bool = False) -> None:
        super().__init__()
        self.upsample: nn.Module
        if bilinear:
            self.upsample = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                nn.Conv2d(in_ch, in_ch // 2, kernel_size=1),
            )
        else:
            self.upsample = nn.ConvTranspose2d(in_ch, in_ch // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        x1 = self.upsample(x1)
        # Pad x1 to the size of x2
        diff_h = x2.shape[2] - x1.shape[2]
        diff_w = x2.shape[3] - x1.shape[3]
        x1 = F.pad(x1, [diff_w // 2, diff_w - diff_w // 2, diff_h // 2, diff_h - diff_h // 2])
        # Concatenate along the channels axis
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class UNet(nn.Module):
    def __init__(self, num_classes: int = 19, num_layers: int = 5, features_start: int = 64, bilinear: bool = False):
        super().__init__()
        self.num_layers = num_layers
        layers = [DoubleConv(3, features_start)]
        feats = features_start
        for _ in range(num_layers - 1):
            layers.append(Down(feats, feats * 2))
            feats *= 2
        for _ in range(num_layers - 1):
            layers.append(Up(feats, feats // 2, bilinear))
            feats //= 2
        layers.append(nn.Conv2d(feats, num_classes, kernel_size=1))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        xi = [self.layers[0](x)]
        # Down path
        for layer in self.layers[1 : self.num_layers]:
            xi.append(layer(xi[-1]))
        # Up path
        for i, layer in enumerate(self.layers[self.num_layers : -1]):
            xi[-1] = layer(xi[-1], xi[-2 - i])
        return self.layers[-1](xi[-1])


class SegModel(L.LightningModule):
    def __init__(
        self,
        batch_size: int = 4,
        lr: float = 1e-3,
        num_layers: int = 2,
        features_start: int = 2,
        bilinear: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.lr = lr
        self.num_layers = num_layers
        self.features_start = features_start
        self.bilinear = bilinear
        self.net = UNet(
            num_classes=3, num_layers=self.num_layers, features_start=self.features_start, bilinear=self.bilinear
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_nb: int) -> Tensor:
        img, mask = batch
        img = img.to(self.dtype)  # the example: img.float()
        mask = mask.long()
        out = self(img)
        loss = F.cross_entropy(out, mask, ignore_index=250)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        img, mask = batch
        img = img.to(self.dtype)  # the example: img.float()
        mask = mask.long()
        out = self(img)
        loss_val = F.cross_entropy(out, mask, ignore_index=250)
        self.log("val_loss", loss_val, prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return [opt], [sch]


# --- 2a and 7. lightning-bolts' SimCLR --------------------------------------------------------------------------------
class SyncFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        ctx.batch_size = tensor.shape[0]

        gathered_tensor = [torch.zeros_like(tensor) for _ in range(torch.distributed.get_world_size())]

        torch.distributed.all_gather(gathered_tensor, tensor)
        gathered_tensor = torch.cat(gathered_tensor, 0)

        return gathered_tensor

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        grad_input = grad_output.clone()
        torch.distributed.all_reduce(grad_input, op=torch.distributed.ReduceOp.SUM, async_op=False)

        idx_from = torch.distributed.get_rank() * ctx.batch_size
        idx_to = (torch.distributed.get_rank() + 1) * ctx.batch_size
        return grad_input[idx_from:idx_to]


class Projection(nn.Module):
    def __init__(self, input_dim: int = 2048, hidden_dim: int = 2048, output_dim: int = 128) -> None:
        super().__init__()
        self.output_dim = output_dim
        self.input_dim = input_dim
        self.hidden_dim = hidden_dim

        self.model = nn.Sequential(
            nn.Linear(self.input_dim, self.hidden_dim),
            nn.BatchNorm1d(self.hidden_dim),
            nn.ReLU(),
            nn.Linear(self.hidden_dim, self.output_dim, bias=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.model(x)
        return F.normalize(x, dim=1)


class BoltsEncoder(nn.Module):
    """bolts' ``resnet18(first_conv=False, maxpool1=False, return_all_feature_maps=False)``, tiny: it returns a list
    of feature maps, the pooled last one last."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return [torch.flatten(self.avgpool(x), 1)]


def fn(step: int, warmup_steps: int, total_steps: int, cosine: bool = True, linear: bool = False) -> float:
    """bolts' ``pl_bolts.optimizers.lr_scheduler.linear_warmup_decay``'s function."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))

    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    if cosine:
        # cosine decay
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if linear:
        # linear decay
        return 1.0 - progress
    # no decay
    return 1.0


def linear_warmup_decay(warmup_steps: int, total_steps: int, cosine: bool = True, linear: bool = False) -> Any:
    return partial(fn, warmup_steps=warmup_steps, total_steps=total_steps, cosine=cosine, linear=linear)


class SimCLR(L.LightningModule):
    def __init__(
        self,
        num_samples: int = 13,
        batch_size: int = 5,
        hidden_mlp: int = 8,
        feat_dim: int = 4,
        warmup_epochs: int = 1,
        max_epochs: int = 2,
        temperature: float = 0.1,
        optim: str = "adam",
        exclude_bn_bias: bool = True,
        weight_decay: float = 1e-6,
        learning_rate: float = 1e-2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.hidden_mlp = hidden_mlp
        self.feat_dim = feat_dim
        self.optim = optim
        self.exclude_bn_bias = exclude_bn_bias
        self.weight_decay = weight_decay
        self.temperature = temperature
        self.learning_rate = learning_rate
        self.warmup_epochs = warmup_epochs
        self.max_epochs = max_epochs

        self.encoder = BoltsEncoder(width=4)
        # h -> || -> z
        self.projection = Projection(input_dim=4, hidden_dim=self.hidden_mlp, output_dim=self.feat_dim)

        # compute iters per epoch
        global_batch_size = self.batch_size
        self.train_iters_per_epoch = math.ceil(self.num_samples / global_batch_size)

    def forward(self, x: Tensor) -> Tensor:
        # bolts resnet returns a list
        return self.encoder(x)[-1]

    def shared_step(self, batch: Any) -> Tensor:
        # final image in tuple is for online eval
        (img1, img2, _), y = batch

        # get h representations, bolts resnet returns a list
        h1 = self(img1)
        h2 = self(img2)

        # get z representations
        z1 = self.projection(h1)
        z2 = self.projection(h2)

        return self.nt_xent_loss(z1, z2, self.temperature)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.shared_step(batch)

        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.shared_step(batch)

        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def exclude_from_wt_decay(self, named_params: Any, weight_decay: float, skip_list: Any = ("bias", "bn")) -> Any:
        params = []
        excluded_params = []

        for name, param in named_params:
            if not param.requires_grad:
                continue
            elif any(layer_name in name for layer_name in skip_list):
                excluded_params.append(param)
            else:
                params.append(param)

        return [
            {"params": params, "weight_decay": weight_decay},
            {"params": excluded_params, "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        if self.exclude_bn_bias:
            params = self.exclude_from_wt_decay(self.named_parameters(), weight_decay=self.weight_decay)
        else:
            params = self.parameters()

        optimizer = torch.optim.Adam(params, lr=self.learning_rate, weight_decay=self.weight_decay)

        warmup_steps = self.train_iters_per_epoch * self.warmup_epochs
        total_steps = self.train_iters_per_epoch * self.max_epochs

        scheduler = {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                linear_warmup_decay(warmup_steps, total_steps, cosine=True),
            ),
            "interval": "step",
            "frequency": 1,
        }

        return [optimizer], [scheduler]

    def nt_xent_loss(self, out_1: Tensor, out_2: Tensor, temperature: float, eps: float = 1e-6) -> Tensor:
        """
        assume out_1 and out_2 are normalized
        out_1: [batch_size, dim]
        out_2: [batch_size, dim]
        """
        # gather representations in case of distributed training
        # out_1_dist: [batch_size * world_size, dim]
        # out_2_dist: [batch_size * world_size, dim]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            out_1_dist = SyncFunction.apply(out_1)
            out_2_dist = SyncFunction.apply(out_2)
        else:
            out_1_dist = out_1
            out_2_dist = out_2

        # out: [2 * batch_size, dim]
        # out_dist: [2 * batch_size * world_size, dim]
        out = torch.cat([out_1, out_2], dim=0)
        out_dist = torch.cat([out_1_dist, out_2_dist], dim=0)

        # cov and sim: [2 * batch_size, 2 * batch_size * world_size]
        # neg: [2 * batch_size]
        cov = torch.mm(out, out_dist.t().contiguous())
        sim = torch.exp(cov / temperature)
        neg = sim.sum(dim=-1)

        # from each row, subtract e^(1/temp) to remove similarity measure for x1.x1
        row_sub = Tensor(neg.shape).fill_(math.e ** (1 / temperature)).to(neg.device)
        neg = torch.clamp(neg - row_sub, min=eps)  # clamp for numerical stability

        # Positive similarity, pos becomes [2 * batch_size]
        pos = torch.exp(torch.sum(out_1 * out_2, dim=-1) / temperature)
        pos = torch.cat([pos, pos], dim=0)

        return -torch.log(pos / (neg + eps)).mean()


class SimCLRAllGather(SimCLR):
    """bolts' SimCLR with the fix the package names: ``nt_xent_loss`` overridden to gather through
    ``self.all_gather(z, sync_grads=True)`` (DDP's ``(N, B, D)`` flattened), the rest of the loss as bolts writes it."""

    def nt_xent_loss(self, out_1: Tensor, out_2: Tensor, temperature: float, eps: float = 1e-6) -> Tensor:
        out_1_dist = self.all_gather(out_1, sync_grads=True)
        out_2_dist = self.all_gather(out_2, sync_grads=True)
        if self.trainer.world_size > 1:
            out_1_dist, out_2_dist = out_1_dist.flatten(0, 1), out_2_dist.flatten(0, 1)

        out = torch.cat([out_1, out_2], dim=0)
        out_dist = torch.cat([out_1_dist, out_2_dist], dim=0)

        cov = torch.mm(out, out_dist.t().contiguous())
        sim = torch.exp(cov / temperature)
        neg = sim.sum(dim=-1)

        row_sub = Tensor(neg.shape).fill_(math.e ** (1 / temperature)).to(neg.device)
        neg = torch.clamp(neg - row_sub, min=eps)  # clamp for numerical stability

        pos = torch.exp(torch.sum(out_1 * out_2, dim=-1) / temperature)
        pos = torch.cat([pos, pos], dim=0)

        return -torch.log(pos / (neg + eps)).mean()


# --- 2b. Lightning's Barlow Twins tutorial ---------------------------------------------------------------------------
class BarlowTwinsLoss(nn.Module):
    def __init__(self, batch_size: int, lambda_coeff: float = 5e-3, z_dim: int = 128) -> None:
        super().__init__()

        self.z_dim = z_dim
        self.batch_size = batch_size
        self.lambda_coeff = lambda_coeff

    def off_diagonal_ele(self, x: Tensor) -> Tensor:
        # taken from: https://github.com/facebookresearch/barlowtwins/blob/main/main.py
        # return a flattened view of the off-diagonal elements of a square matrix
        n, m = x.shape
        assert n == m
        return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()

    def forward(self, z1: Tensor, z2: Tensor) -> Tensor:
        # N x D, where N is the batch size and D is output dim of projection head
        z1_norm = (z1 - torch.mean(z1, dim=0)) / torch.std(z1, dim=0)
        z2_norm = (z2 - torch.mean(z2, dim=0)) / torch.std(z2, dim=0)

        cross_corr = torch.matmul(z1_norm.T, z2_norm) / self.batch_size

        on_diag = torch.diagonal(cross_corr).add_(-1).pow_(2).sum()
        off_diag = self.off_diagonal_ele(cross_corr).pow_(2).sum()

        return on_diag + self.lambda_coeff * off_diag


class ProjectionHead(nn.Module):
    def __init__(self, input_dim: int = 2048, hidden_dim: int = 2048, output_dim: int = 128) -> None:
        super().__init__()

        self.projection_head = nn.Sequential(
            nn.Linear(input_dim, hidden_dim, bias=True),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim, bias=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.projection_head(x)


def barlow_fn(warmup_steps: int, step: int) -> float:
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    return 1.0


def barlow_linear_warmup_decay(warmup_steps: int) -> Any:
    return partial(barlow_fn, warmup_steps)


def barlow_encoder() -> nn.Module:
    """The tutorial's ``resnet18(zero_init_residual=True)`` with a 3x3 ``conv1``, no max-pool and ``fc = Identity``."""
    encoder = ResNet(num_classes=4)
    encoder.conv1 = nn.Conv2d(3, 4, kernel_size=3, stride=1, padding=1, bias=False)
    encoder.maxpool = nn.MaxPool2d(kernel_size=1, stride=1)
    encoder.fc = nn.Identity()
    return encoder


class BarlowTwins(L.LightningModule):
    def __init__(
        self,
        encoder: nn.Module | None = None,
        encoder_out_dim: int = 8,
        num_training_samples: int = 13,
        batch_size: int = 5,
        lambda_coeff: float = 5e-3,
        z_dim: int = 6,
        learning_rate: float = 1e-2,
        warmup_epochs: int = 1,
        max_epochs: int = 2,
    ) -> None:
        super().__init__()

        self.encoder = encoder if encoder is not None else barlow_encoder()
        self.projection_head = ProjectionHead(input_dim=encoder_out_dim, hidden_dim=encoder_out_dim, output_dim=z_dim)
        self.loss_fn = BarlowTwinsLoss(batch_size=batch_size, lambda_coeff=lambda_coeff, z_dim=z_dim)

        self.learning_rate = learning_rate
        self.warmup_epochs = warmup_epochs
        self.max_epochs = max_epochs

        self.train_iters_per_epoch = num_training_samples // batch_size

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x)

    def shared_step(self, batch: Any) -> Tensor:
        (x1, x2, _), _ = batch

        z1 = self.projection_head(self.encoder(x1))
        z2 = self.projection_head(self.encoder(x2))

        # The tutorial runs on one device: its cross-correlation uses the whole batch's statistics. Gathered, as the
        # package docs say, so that every device sees the whole batch (DDP: (N, B, D), flattened).
        z1, z2 = self.all_gather(z1, sync_grads=True), self.all_gather(z2, sync_grads=True)
        if self.trainer.world_size > 1:
            z1, z2 = z1.flatten(0, 1), z2.flatten(0, 1)

        return self.loss_fn(z1, z2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.shared_step(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.shared_step(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.learning_rate)

        warmup_steps = self.train_iters_per_epoch * self.warmup_epochs

        scheduler = {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                barlow_linear_warmup_decay(warmup_steps),
            ),
            "interval": "step",
            "frequency": 1,
        }

        return [optimizer], [scheduler]


class OnlineFineTuner(Callback):
    """The tutorial's linear probe, trained in ``on_train_batch_end`` on the frozen encoder's features."""

    def __init__(self, encoder_output_dim: int, num_classes: int) -> None:
        super().__init__()

        self.optimizer: torch.optim.Optimizer | None = None

        self.encoder_output_dim = encoder_output_dim
        self.num_classes = num_classes

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # add linear_eval layer and optimizer
        # (the tutorial: .to(pl_module.device); the dtype too, so that it runs in float64)
        pl_module.online_finetuner = nn.Linear(self.encoder_output_dim, self.num_classes).to(
            pl_module.device, pl_module.dtype
        )
        self.optimizer = torch.optim.Adam(pl_module.online_finetuner.parameters(), lr=1e-2)

    def extract_online_finetuning_view(self, batch: Any, device: torch.device) -> tuple[Tensor, Tensor]:
        (_, _, finetune_view), y = batch
        finetune_view = finetune_view.to(device)
        y = y.to(device)

        return finetune_view, y

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        x, y = self.extract_online_finetuning_view(batch, pl_module.device)

        with torch.no_grad():
            feats = pl_module(x)

        feats = feats.detach()
        preds = pl_module.online_finetuner(feats)
        loss = F.cross_entropy(preds, y)

        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

        acc = accuracy(F.softmax(preds, dim=1), y, task="multiclass", num_classes=4)
        pl_module.log("online_train_acc", acc, on_step=True, on_epoch=False)
        pl_module.log("online_train_loss", loss, on_step=True, on_epoch=False)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        x, y = self.extract_online_finetuning_view(batch, pl_module.device)

        with torch.no_grad():
            feats = pl_module(x)

        feats = feats.detach()
        preds = pl_module.online_finetuner(feats)
        loss = F.cross_entropy(preds, y)

        acc = accuracy(F.softmax(preds, dim=1), y, task="multiclass", num_classes=4)
        pl_module.log("online_val_acc", acc, on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log("online_val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)


# --- 3. Lightning's DQN example --------------------------------------------------------------------------------------
class Discrete:
    """gym's ``spaces.Discrete``: ``n`` and ``sample()`` (numpy's global generator, as old gym's seeding was)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def sample(self) -> int:
        return int(np.random.randint(self.n))


class RingWalk:
    """A gym-like environment (old gym API): a walker on a ring of ``size`` cells, rewarded at the last cell, done after
    ``episode`` steps; observations are 4 floats, as CartPole's."""

    def __init__(self, size: int = 5, episode: int = 6) -> None:
        self.size, self.episode = size, episode
        self.observation_space = SimpleNamespace(shape=(4,))
        self.action_space = Discrete(2)
        self.pos = self.t = 0

    def _obs(self) -> np.ndarray:
        angle = 2 * np.pi * self.pos / self.size
        return np.array([self.pos / self.size, np.sin(angle), np.cos(angle), self.t / self.episode], dtype=np.float32)

    def reset(self) -> np.ndarray:
        self.pos = self.t = 0
        return self._obs()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, dict]:
        self.t += 1
        self.pos = (self.pos + (1 if action else -1)) % self.size
        reward = 1.0 if self.pos == self.size - 1 else 0.0
        return self._obs(), reward, self.t >= self.episode, {}


class DQN(nn.Module):
    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.to(self.net[0].weight.dtype))  # the example: self.net(x.float())


# Named tuple for storing experience steps gathered in training
Experience = namedtuple("Experience", field_names=["state", "action", "reward", "done", "new_state"])


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        self.buffer: deque[Experience] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple:
        indices = np.random.choice(len(self.buffer), batch_size, replace=False)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices))

        return (
            np.array(states),
            np.array(actions),
            np.array(rewards, dtype=np.float32),
            np.array(dones, dtype=bool),
            np.array(next_states),
        )


class RLDataset(IterableDataset):
    def __init__(self, buffer: ReplayBuffer, sample_size: int = 200) -> None:
        self.buffer = buffer
        self.sample_size = sample_size

    def __iter__(self) -> Any:
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Agent:
    def __init__(self, env: RingWalk, replay_buffer: ReplayBuffer) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.reset()
        self.state = self.env.reset()

    def reset(self) -> None:
        self.state = self.env.reset()

    def get_action(self, net: nn.Module, epsilon: float, device: str) -> int:
        if np.random.random() < epsilon:
            action = self.env.action_space.sample()
        else:
            state = torch.tensor(np.array([self.state]))
            if device not in ["cpu"]:
                state = state.cuda(device)
            q_values = net(state)
            _, action = torch.max(q_values, dim=1)
            action = int(action.item())
        return action

    @torch.no_grad()
    def play_step(self, net: nn.Module, epsilon: float = 0.0, device: str = "cpu") -> tuple[float, bool]:
        action = self.get_action(net, epsilon, device)

        # do step in the environment
        new_state, reward, done, _ = self.env.step(action)

        exp = Experience(self.state, action, reward, done, new_state)

        self.replay_buffer.append(exp)

        self.state = new_state
        if done:
            self.reset()
        return reward, done


class DQNLightning(L.LightningModule):
    """``play="training_step"``: the example as written; ``play="on_train_batch_start"``: the fix the strategy names
    (the same call, moved before the step). ``target_copy="after_loss"``: the target network copied after the loss is
    computed, as the example does; ``"before_loss"``: at the top of the step."""

    def __init__(
        self,
        play: str = "training_step",
        target_copy: str = "after_loss",
        batch_size: int = 5,
        lr: float = 1e-2,
        gamma: float = 0.99,
        sync_rate: int = 2,
        replay_size: int = 50,
        warm_start_size: int = 20,
        eps_last_frame: int = 200,
        eps_start: float = 1.0,
        eps_end: float = 0.01,
        episode_length: int = 10,
        warm_start_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.play = play
        self.target_copy = target_copy

        self.env = RingWalk()
        obs_size = self.env.observation_space.shape[0]
        n_actions = self.env.action_space.n

        self.net = DQN(obs_size, n_actions)
        self.target_net = DQN(obs_size, n_actions)

        self.buffer = ReplayBuffer(self.hparams.replay_size)
        self.agent = Agent(self.env, self.buffer)
        self.total_reward = 0
        self.episode_reward = 0
        self.populate(self.hparams.warm_start_steps)

    def populate(self, steps: int = 1000) -> None:
        for _ in range(steps):
            self.agent.play_step(self.net, epsilon=1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        states, actions, rewards, dones, next_states = batch

        state_action_values = self.net(states).gather(1, actions.long().unsqueeze(-1)).squeeze(-1)

        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()

        expected_state_action_values = next_state_values * self.hparams.gamma + rewards

        return nn.MSELoss()(state_action_values, expected_state_action_values)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.play == "on_train_batch_start":  # the fix: the step's first lines, moved here
            epsilon = max(
                self.hparams.eps_end, self.hparams.eps_start - self.global_step + 1 / self.hparams.eps_last_frame
            )
            self.played = self.agent.play_step(self.net, epsilon, self.get_device(batch))
            self.episode_reward += self.played[0]

    def training_step(self, batch: Any, nb_batch: int) -> OrderedDict:
        device = self.get_device(batch)
        if self.target_copy == "before_loss" and self.global_step % self.hparams.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        if self.play == "training_step":  # the example as written
            epsilon = max(
                self.hparams.eps_end, self.hparams.eps_start - self.global_step + 1 / self.hparams.eps_last_frame
            )

            # step through environment with agent
            reward, done = self.agent.play_step(self.net, epsilon, device)
            self.episode_reward += reward
        else:
            reward, done = self.played

        # calculates training loss
        loss = self.dqn_mse_loss(batch)

        if done:
            self.total_reward = self.episode_reward
            self.episode_reward = 0

        # Soft update of target network
        if self.target_copy == "after_loss" and self.global_step % self.hparams.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())

        log = {
            "total_reward": torch.tensor(self.total_reward).to(device),
            "reward": torch.tensor(reward).to(device),
            "train_loss": loss,
        }
        status = {
            "steps": torch.tensor(self.global_step).to(device),
            "total_reward": torch.tensor(self.total_reward).to(device),
        }
        self.log_dict(log)
        self.log("steps", float(self.global_step), prog_bar=True, logger=False)

        return OrderedDict({"loss": loss, "log": log, "progress_bar": status})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizer = torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr)
        return [optimizer]

    def __dataloader(self) -> DataLoader:
        dataset = RLDataset(self.buffer, self.hparams.episode_length)
        return DataLoader(dataset=dataset, batch_size=self.hparams.batch_size, sampler=None)

    def train_dataloader(self) -> DataLoader:
        return self.__dataloader()

    def get_device(self, batch: Any) -> str:
        return batch[0].device.index if self.on_gpu else "cpu"


# --- 4. lightning-bolts' MoCo v2 -------------------------------------------------------------------------------------
def precision_at_k(output: Tensor, target: Tensor, top_k: tuple[int, ...] = (1,)) -> list[Tensor]:
    """Computes the accuracy over the k top predictions for the specified values of k."""
    with torch.no_grad():
        maxk = max(top_k)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in top_k:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


class TinyResnet(nn.Module):
    """The template model bolts builds its encoders from (``torchvision.models.resnet18(num_classes=emb_dim)``)."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),
        )  # fmt: skip
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.net(x))


class MoCoV2(L.LightningModule):
    """``update_in="training_step"``: bolts' current code; ``"forward"``: its earlier code (the momentum update at the
    top of ``forward``, under ``torch.no_grad()``). ``queue_arg=True``: bolts passes the queue buffer to ``forward``
    (``self(img_q=..., img_k=..., queue=self.queue)``); ``False``: ``forward`` gets the buffer's name and reads the
    buffer itself (the fix of dp's message: a per-batch value kept out of what is split, as a buffer of the module)."""

    def __init__(
        self,
        update_in: str = "training_step",
        queue_arg: bool = True,
        emb_dim: int = 4,
        num_negatives: int = 21,
        encoder_momentum: float = 0.9,
        softmax_temperature: float = 0.07,
        learning_rate: float = 0.03,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        batch_size: int = 7,
        use_mlp: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.update_in = update_in
        self.queue_arg = queue_arg

        # create the encoders
        # num_classes is the output fc dimension
        self.encoder_q, self.encoder_k = self.init_encoders()

        if use_mlp:  # hack: brute-force replacement
            dim_mlp = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)

        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)  # initialize
            param_k.requires_grad = False  # not update by gradient

        # create the queue
        self.register_buffer("queue", torch.randn(emb_dim, num_negatives))
        self.queue = nn.functional.normalize(self.queue, dim=0)

        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

        # create the validation queue
        self.register_buffer("val_queue", torch.randn(emb_dim, num_negatives))
        self.val_queue = nn.functional.normalize(self.val_queue, dim=0)

        self.register_buffer("val_queue_ptr", torch.zeros(1, dtype=torch.long))

    def init_encoders(self) -> tuple[nn.Module, nn.Module]:
        """Override to add your own encoders."""
        encoder_q = TinyResnet(num_classes=self.hparams.emb_dim)
        encoder_k = TinyResnet(num_classes=self.hparams.emb_dim)

        return encoder_q, encoder_k

    def _momentum_update_key_encoder(self) -> None:
        """Momentum update of the key encoder."""
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            em = self.hparams.encoder_momentum
            param_k.data = param_k.data * em + param_q.data * (1.0 - em)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: Tensor, queue_ptr: Tensor, queue: Tensor) -> None:
        # gather keys before updating queue (bolts: concat_all_gather under DDP; here self.all_gather)
        keys = self.all_gather(keys)
        if self.trainer.world_size > 1:
            keys = keys.flatten(0, 1)

        batch_size = keys.shape[0]

        ptr = int(queue_ptr)
        assert self.hparams.num_negatives % batch_size == 0  # for simplicity

        # replace the keys at ptr (dequeue and enqueue)
        queue[:, ptr : ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.hparams.num_negatives  # move pointer

        queue_ptr[0] = ptr

    def forward(self, img_q: Tensor, img_k: Tensor, queue: Tensor | str) -> tuple[Tensor, Tensor, Tensor]:
        """
        Input:
            img_q: a batch of query images
            img_k: a batch of key images
            queue: a queue from which to pick negative samples
        Output:
            logits, targets
        """

        if isinstance(queue, str):  # the fix: the buffer read here, not passed
            queue = getattr(self, queue)

        # compute query features
        q = self.encoder_q(img_q)  # queries: NxC
        q = nn.functional.normalize(q, dim=1)

        # compute key features
        with torch.no_grad():  # no gradient to keys
            if self.update_in == "forward":
                self._momentum_update_key_encoder()  # update the key encoder

            # shuffle for making use of BN
            if self._use_ddp(self.trainer):
                raise NotImplementedError("bolts' _batch_shuffle_ddp: not part of this stand-in")

            k = self.encoder_k(img_k)  # keys: NxC
            k = nn.functional.normalize(k, dim=1)

        # compute logits
        # Einstein sum is more intuitive
        # positive logits: Nx1
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        # negative logits: NxK
        l_neg = torch.einsum("nc,ck->nk", [q, queue.clone().detach()])

        # logits: Nx(1+K)
        logits = torch.cat([l_pos, l_neg], dim=1)

        # apply temperature
        logits /= self.hparams.softmax_temperature

        # labels: positive key indicators
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        labels = labels.type_as(logits)

        return logits, labels, k

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (img_1, img_2), _ = batch

        if self.update_in == "training_step":
            self._momentum_update_key_encoder()  # update the key encoder
        output, target, keys = self(img_q=img_1, img_k=img_2, queue=self.queue if self.queue_arg else "queue")
        self._dequeue_and_enqueue(keys, queue=self.queue, queue_ptr=self.queue_ptr)  # dequeue and enqueue

        loss = F.cross_entropy(output, target.long())  # bolts: output.float(), a float32 loss

        acc1, acc5 = precision_at_k(output, target, top_k=(1, 5))

        log = {"train_loss": loss, "train_acc1": acc1, "train_acc5": acc5}
        self.log_dict(log)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (img_1, img_2), labels = batch

        output, target, keys = self(img_q=img_1, img_k=img_2, queue=self.val_queue if self.queue_arg else "val_queue")
        self._dequeue_and_enqueue(keys, queue=self.val_queue, queue_ptr=self.val_queue_ptr)  # dequeue and enqueue

        loss = F.cross_entropy(output, target.long())

        acc1, acc5 = precision_at_k(output, target, top_k=(1, 5))

        results = {"val_loss": loss, "val_acc1": acc1, "val_acc5": acc5}
        self.log_dict(results)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(
            self.parameters(),
            self.hparams.learning_rate,
            momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
        return optimizer

    @staticmethod
    def _use_ddp(trainer: L.Trainer) -> bool:
        return isinstance(trainer.strategy, DDPStrategy)


# --- 5. a per-sample-pairs collate -----------------------------------------------------------------------------------
class PairsClassifier(L.LightningModule):
    """Two views per sample in the collate's list of ``((v1, v2), label)`` items; a classifier with BatchNorm trained
    on both views, an accuracy metric, and an agreement score between the views."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.head = nn.Linear(4, 4)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(4, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    @staticmethod
    def unpack(batch: list[Any]) -> tuple[Tensor, Tensor, Tensor]:
        v1 = torch.stack([views[0] for views, _ in batch])
        v2 = torch.stack([views[1] for views, _ in batch])
        y = torch.stack([label for _, label in batch])
        return v1, v2, y

    def training_step(self, batch: list[Any], batch_idx: int) -> Tensor:
        v1, v2, y = self.unpack(batch)
        logits1, logits2 = self(v1), self(v2)
        loss = (F.cross_entropy(logits1, y) + F.cross_entropy(logits2, y)) / 2
        self.train_acc(logits1, y)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, batch_size=len(batch))
        self.log("agree", (logits1.argmax(1) == logits2.argmax(1)).double().mean(), batch_size=len(batch))
        return loss

    def validation_step(self, batch: list[Any], batch_idx: int) -> None:
        v1, v2, y = self.unpack(batch)
        self.log("val_loss", F.cross_entropy(self(v1), y), batch_size=len(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


# --- 6. Lightning's basic GAN example --------------------------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 8, normalize=False),
            *block(8, 8),
            *block(8, 12),
            nn.Linear(12, int(np.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple) -> None:
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 12),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(12, 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(8, 1),
        )

    def forward(self, img: Tensor) -> Tensor:
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(L.LightningModule):
    def __init__(
        self,
        img_shape: tuple = (1, 4, 4),
        lr: float = 0.01,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch: Any) -> None:
        imgs, _, z = batch  # the example: imgs, _ = batch; z = torch.randn(imgs.shape[0], latent_dim) here

        opt_g, opt_d = self.optimizers()

        # sample noise (drawn in the DataLoader, so that one device and the replicas see the same numbers)
        z = z.type_as(imgs)

        # Train generator
        # ground truth result (ie: all fake)
        # put on GPU because we created this tensor inside training_loop
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        # adversarial loss is binary cross-entropy
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator
        # Measure discriminator's ability to classify real from generated samples
        self.toggle_optimizer(opt_d)

        # how well can it label as real?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        # how well can it label as fake?
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # discriminator loss is the average of these
        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []

    def on_train_epoch_end(self) -> None:
        # the example's on_validation_epoch_end, without torchvision's make_grid: sample from the fixed noise
        z = self.validation_z.type_as(self.generator.model[0].weight)
        self.sample_imgs = self(z).detach()


# --- 8. lightning-hydra-template's MNISTLitModule, with F1 and metrics in a dict --------------------------------------
class SimpleDenseNet(nn.Module):
    def __init__(
        self, input_size: int = 784, lin1_size: int = 256, lin2_size: int = 256, lin3_size: int = 256,
        output_size: int = 10,
    ) -> None:  # fmt: skip
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x: Tensor) -> Tensor:
        batch_size, channels, width, height = x.size()

        # (batch, 1, width, height) -> (batch, 1*width*height)
        x = x.view(batch_size, -1)

        return self.model(x)


class MNISTLitModule(L.LightningModule):
    def __init__(self, compile: bool = False) -> None:
        super().__init__()

        # this line allows to access init params with 'self.hparams' attribute
        # also ensures init params will be stored in ckpt
        self.save_hyperparameters(logger=False)

        self.net = SimpleDenseNet(input_size=12, lin1_size=8, lin2_size=8, lin3_size=8, output_size=4)

        # loss function
        self.criterion = torch.nn.CrossEntropyLoss()

        # metric objects for calculating and averaging accuracy across batches
        self.train_acc = Accuracy(task="multiclass", num_classes=4)
        self.val_acc = Accuracy(task="multiclass", num_classes=4)
        self.test_acc = Accuracy(task="multiclass", num_classes=4)

        # an F1 whose per-step value is logged from the step
        self.train_f1 = torchmetrics.F1Score(task="multiclass", num_classes=4, average="macro")

        # metrics held in a plain dict attribute (not a MetricCollection, so not registered as submodules)
        self.metrics = {
            "precision": torchmetrics.Precision(task="multiclass", num_classes=4, average="macro"),
            "recall": torchmetrics.Recall(task="multiclass", num_classes=4, average="macro"),
        }

        # for averaging loss across batches
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

        # for tracking best so far validation accuracy
        self.val_acc_best = MaxMetric()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # by default lightning executes validation step sanity checks before training starts,
        # so it's worth to make sure validation metrics don't store results from these checks
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, preds, targets = self.model_step(batch)

        # update and log metrics
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/f1", self.train_f1(preds, targets), on_step=True, on_epoch=True)
        for name, metric in self.metrics.items():
            metric.update(preds, targets)
            self.log(f"train/{name}", metric, on_step=False, on_epoch=True, metric_attribute=f"metrics.{name}")

        # return loss or backpropagation will fail
        return loss

    def on_train_epoch_end(self) -> None:
        "Lightning hook that is called when a training epoch ends."
        pass

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)

        # update and log metrics
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()  # get current val acc
        self.val_acc_best(acc)  # update best so far val acc
        # log `val_acc_best` as a value through `.compute()` method, instead of as a metric object
        # otherwise metric would be reset by lightning after each epoch
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(params=self.trainer.model.parameters(), lr=0.001, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1, patience=10)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1},
        }
