"""The five benchmark workloads, built from code with random init and synthetic data.

Each workload has a ``cpu`` configuration (shrunk so that a step takes 0.3–3 s on the
emulated 2x2 CPU cluster) and a ``full`` one (the published size, for GPU runs).
The report prints the exact configuration and parameter count of what ran.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


# -- ResNet-50 -----------------------------------------------------------------

class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.down = None
        if stride != 1 or in_ch != out_ch:
            self.down = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False),
                                      nn.BatchNorm2d(out_ch))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, base_width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base_width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(base_width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, in_ch = [], base_width
        for i, blocks in enumerate((3, 4, 6, 3)):
            width = base_width * 2 ** i
            for j in range(blocks):
                layers.append(Bottleneck(in_ch, width, 2 if (j == 0 and i > 0) else 1))
                in_ch = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


# -- VGG-16 --------------------------------------------------------------------

VGG16_CHANNELS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M")


class VGG16(nn.Module):
    def __init__(self, image: int = 224, hidden: int = 4096, num_classes: int = 1000):
        super().__init__()
        layers, in_ch = [], 3
        for c in VGG16_CHANNELS:
            if c == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(in_ch, c, 3, padding=1), nn.ReLU()]
                in_ch = c
        self.features = nn.Sequential(*layers)
        spatial = image // 32
        self.classifier = nn.Sequential(nn.Linear(512 * spatial * spatial, hidden), nn.ReLU(),
                                        nn.Linear(hidden, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


# -- Transformer encoders: BERT and ViT ---------------------------------------

# nn.TransformerEncoderLayer registers norm1 and norm2 after its linear layers, so
# reverse registration order (how fgpsdp fills its buckets) is not the order backward
# makes gradients ready: the bucket holding a layer's norm1 waits until the end of
# that layer's backward. With this variable set to "forward", each layer's submodules
# are registered in the order a norm_first layer runs them: same model, same initial
# values (drawn before the reordering), buckets ready in order. An experiment's switch
# (docs/benchmarks/*-bucket-ready-order.md); emulated.py writes it into its report's command.
ENCODER_ORDER_ENV = "FGPSDP_BENCH_ENCODER_ORDER"
_FORWARD_ORDER = ("norm1", "self_attn", "dropout1", "norm2", "linear1", "dropout", "linear2",
                  "dropout2")


def _register_in_forward_order(layer: nn.TransformerEncoderLayer) -> None:
    assert layer.norm_first, "the order below is a norm_first layer's"
    names = [n for n in _FORWARD_ORDER if n in layer._modules]
    names += [n for n in layer._modules if n not in names]
    layer._modules = {n: layer._modules[n] for n in names}


class Encoder(nn.Module):
    def __init__(self, d_model: int, n_layer: int, n_head: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        if os.environ.get(ENCODER_ORDER_ENV) == "forward":
            for each in self.layers.layers:
                _register_in_forward_order(each)

    def forward(self, x):
        return self.norm(self.layers(x))


class BERT(nn.Module):
    """BERT-style masked LM: token + position + segment embeddings, encoder, tied head."""

    def __init__(self, vocab: int = 30522, seq: int = 512, d_model: int = 768,
                 n_layer: int = 12, n_head: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.seg = nn.Embedding(2, d_model)
        self.encoder = Encoder(d_model, n_layer, n_head)
        self.transform = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.decoder = nn.Linear(d_model, vocab)
        self.decoder.weight = self.tok.weight

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos) + self.seg(torch.zeros_like(tokens))
        return self.decoder(self.transform(self.encoder(x)))


class ViT(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, d_model: int = 768, n_layer: int = 12,
                 n_head: int = 12, num_classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, d_model, patch, patch)
        n_patches = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, d_model) * 0.02)
        self.encoder = Encoder(d_model, n_layer, n_head)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


# -- registry ------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadConfig:
    name: str
    size: str
    batch: int  # per rank
    model_kwargs: dict
    input_kind: str  # "image" or "tokens"
    image: int = 0
    seq: int = 0
    vocab: int = 0
    classes: int = 0


CONFIGS = {
    ("resnet50", "cpu"): WorkloadConfig("resnet50", "cpu", 4, {"base_width": 64, "num_classes": 100},
                                        "image", image=32, classes=100),
    ("resnet50", "full"): WorkloadConfig("resnet50", "full", 64, {}, "image", image=224, classes=1000),
    ("vgg16", "cpu"): WorkloadConfig("vgg16", "cpu", 4, {"image": 32, "hidden": 512, "num_classes": 10},
                                     "image", image=32, classes=10),
    ("vgg16", "full"): WorkloadConfig("vgg16", "full", 32, {}, "image", image=224, classes=1000),
    ("bert", "cpu"): WorkloadConfig("bert", "cpu", 4, {"vocab": 8192, "seq": 64, "d_model": 512,
                                                       "n_layer": 4, "n_head": 8},
                                    "tokens", seq=64, vocab=8192),
    ("bert", "full"): WorkloadConfig("bert", "full", 16, {}, "tokens", seq=512, vocab=30522),
    ("gpt2", "cpu"): WorkloadConfig("gpt2", "cpu", 4, {"vocab_size": 8192, "block_size": 64,
                                                       "n_layer": 4, "n_head": 8, "d_model": 512},
                                    "tokens", seq=64, vocab=8192),
    ("gpt2", "full"): WorkloadConfig("gpt2", "full", 8, {"vocab_size": 50257, "block_size": 1024,
                                                         "n_layer": 12, "n_head": 12, "d_model": 768},
                                     "tokens", seq=1024, vocab=50257),
    ("vit", "cpu"): WorkloadConfig("vit", "cpu", 4, {"image": 64, "patch": 8, "d_model": 512,
                                                     "n_layer": 4, "n_head": 8, "num_classes": 100},
                                   "image", image=64, classes=100),
    ("vit", "full"): WorkloadConfig("vit", "full", 32, {}, "image", image=224, classes=1000),
}
WORKLOADS = ("resnet50", "vgg16", "bert", "gpt2", "vit")


def build_model(cfg: WorkloadConfig) -> nn.Module:
    if cfg.name == "resnet50":
        return ResNet50(**cfg.model_kwargs)
    if cfg.name == "vgg16":
        return VGG16(**cfg.model_kwargs)
    if cfg.name == "bert":
        return BERT(**cfg.model_kwargs)
    if cfg.name == "gpt2":
        return GPT(GPTConfig(**cfg.model_kwargs, tie_embeddings=True))
    if cfg.name == "vit":
        return ViT(**cfg.model_kwargs)
    raise ValueError(cfg.name)


def make_batch(cfg: WorkloadConfig, step: int, rank: int, device="cpu"):
    """Synthetic (inputs, targets) for one rank and step, the same for every system."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    if cfg.input_kind == "image":
        x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=g)
        y = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
    else:
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
        y = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return x.to(device), y.to(device)


def loss_fn(cfg: WorkloadConfig) -> Callable:
    def loss(out, y):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return loss


def describe(cfg: WorkloadConfig, model: nn.Module) -> dict:
    return {**asdict(cfg), "parameters": sum(p.numel() for p in model.parameters())}
