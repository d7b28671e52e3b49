"""WavTokenizer building blocks: SEANet encoder, Euclidean codebook, Vocos backbone, iSTFT head.

Each block computes what the official WavTokenizer modules compute, operation for operation (same
padding, same op order, same expression for the codebook distance), so float32 results agree with the
reference to the last bit where the kernels are the same. Submodule names follow the official
checkpoint keys below their prefixes (`encoder.model.3.conv.conv.weight` is the official
`feature_extractor.encodec.encoder.model.3.conv.conv.weight`), so loading is a plain `load_state_dict`
after `wavtokenizer.py` has renamed the prefixes and folded the weight norm.

Weight norm is folded into plain conv weights at load time (`fold_weight_norm` in wavtokenizer.py):
the reference recomputes `torch._weight_norm(v, g)` on every forward, we compute it once; the
kernel is deterministic, so the effective weights are identical.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mmtok.codecs.base import Conv1d, row_blocks

# ---------------------------------------------------------------------------------------------
# SEANet encoder (EnCodec's, non-causal, reflect padding, ELU, as configured by EncodecFeatures)
# ---------------------------------------------------------------------------------------------

N_FILTERS = 32  # EncodecFeatures hard-codes the SEANet encoder size; only the strides are configurable
DIMENSION = 512
LSTM_LAYERS = 2
KERNEL_SIZE = 7
RESIDUAL_KERNEL_SIZE = 3


def pad1d(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Reflect padding that also works when the input is not longer than the padding.

    As in EnCodec: zeros are appended first so that the reflection has enough samples, and removed
    again after padding (the output is `left + length + right` long either way).
    """
    if left == right == 0:
        return x  # the reference copies here; skipping the copy leaves every value unchanged
    length = x.shape[-1]
    extra = max(left, right) - length + 1 if length <= max(left, right) else 0
    if extra:
        x = F.pad(x, (0, extra))
    padded = F.pad(x, (left, right), mode="reflect")
    return padded[..., : padded.shape[-1] - extra]


class NormConv1d(nn.Module):
    """Holds the conv under the official `conv.conv` key path (weight norm already folded)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.conv = Conv1d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class SConv1d(nn.Module):
    """Non-causal conv whose output has ceil(length / stride) frames.

    Total padding is kernel - stride, split with the extra sample on the left (EnCodec's rule), plus
    right padding so that the last window is complete.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.conv = NormConv1d(in_channels, out_channels, kernel_size, stride)
        self.kernel_size = kernel_size
        self.stride = stride
        padding_total = kernel_size - stride
        self.pad_right = padding_total // 2
        self.pad_left = padding_total - self.pad_right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        extra = -(-length // self.stride) * self.stride - length  # complete the last window
        return self.conv(pad1d(x, self.pad_left, self.pad_right + extra))

    @property
    def lookahead(self) -> int:
        """Input frames beyond an output frame's start that it reads (kernel - 1 - left padding)."""
        return self.kernel_size - 1 - self.pad_left


class SEANetResnetBlock(nn.Module):
    """ELU -> conv k3 (dim -> dim/2) -> ELU -> conv k1 (dim/2 -> dim), plus a 1x1 conv shortcut."""

    def __init__(self, dim: int):
        super().__init__()
        hidden = dim // 2
        self.block = nn.Sequential(nn.ELU(), SConv1d(dim, hidden, RESIDUAL_KERNEL_SIZE),
                                   nn.ELU(), SConv1d(hidden, dim, 1))
        self.shortcut = SConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.block(x)


class SLSTM(nn.Module):
    """Unidirectional (causal) LSTM over time with a skip connection; [B, C, T] in and out."""

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(2, 0, 1)
        y, _ = self.lstm(x)
        return (y + x).permute(1, 2, 0)


class SEANetEncoder(nn.Module):
    """Waveform [B, 1, n] -> latents [B, 512, ceil(n / hop)].

    `ratios` is the config's `dowmsamples` list, which EnCodec applies in reverse order
    ([6, 5, 5, 4] -> strides 4, 5, 5, 6). Layout of `model` (indices are checkpoint keys): conv k7;
    per stride: residual block, ELU, strided conv (kernel 2*stride); LSTM; ELU; conv k7 to 512.
    """

    def __init__(self, ratios: list[int]):
        super().__init__()
        self.strides = list(reversed(ratios))
        channels = N_FILTERS
        layers: list[nn.Module] = [SConv1d(1, channels, KERNEL_SIZE)]
        for stride in self.strides:
            layers += [SEANetResnetBlock(channels), nn.ELU(), SConv1d(channels, channels * 2, 2 * stride, stride)]
            channels *= 2
        layers += [SLSTM(channels, LSTM_LAYERS), nn.ELU(), SConv1d(channels, DIMENSION, KERNEL_SIZE)]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @property
    def hop(self) -> int:
        hop = 1
        for stride in self.strides:
            hop *= stride
        return hop

    def lookahead_samples(self) -> int:
        """How far past its own first sample a code's receptive field reaches, in samples.

        Code f depends on input samples up to hop * f + lookahead_samples() (the LSTM is causal and
        adds none). This bounds which codes of a clip can change when zeros are appended to it.
        """
        reach, scale = 0, 1
        for layer in self.model:
            convs = layer.block if isinstance(layer, SEANetResnetBlock) else [layer]
            for conv in convs:
                if isinstance(conv, SConv1d):
                    reach += conv.lookahead * scale
                    scale *= conv.stride
        return reach


class Codebook(nn.Module):
    """The single Euclidean codebook (4,096 x 512 in the 40 Hz model), held as buffers, never updated.

    `inited` is kept because the official code re-initializes the codebook by k-means on the first
    batch when it is 0; the loader refuses such a checkpoint. The EMA statistics (`cluster_size`,
    `embed_avg`) are training-only and are not loaded.
    """

    # Frames per distance matrix block (128 x 4,096 floats, 2 MiB), the same for every batch: the last
    # block is zero-padded, so each block's matmul runs one kernel and a frame's code ignores its batch.
    ROWS_PER_CHUNK = 128  # frames per block on the CPU (small: a short clip pads less)
    ROWS_PER_CHUNK_DEVICE = 4096  # on a GPU (fewer launches; 4,096 x 16,384 distances = 256 MiB at most)

    def __init__(self, codebook_size: int, dim: int = DIMENSION):
        super().__init__()
        self.register_buffer("embed", torch.zeros(codebook_size, dim))
        self.register_buffer("inited", torch.zeros(1))
        self.register_buffer("embed_sq", torch.zeros(1, codebook_size), persistent=False)

    def refresh(self) -> None:
        """Recompute |e|^2 after loading, with the reference's expression (sum over dim 0 of embed.T)."""
        self.embed_sq = self.embed.t().pow(2).sum(0, keepdim=True)

    def nearest(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, D, T] -> int64 codes [B, T]: argmax of -(|x|^2 - 2 x.e + |e|^2), as the reference.

        The expression and its evaluation order match the official EuclideanCodebook.quantize, so
        rounding (and thus near-ties) resolve the same way; max() returns the first maximal index.
        Rows are processed in blocks of exactly ROWS_PER_CHUNK frames, so a frame's code does not
        depend on the other frames of the batch.
        """
        batch, dim, frames = latents.shape
        rows = latents.transpose(1, 2).reshape(-1, dim)
        embed_t = self.embed.t()
        blocks = row_blocks(rows, self.ROWS_PER_CHUNK, self.ROWS_PER_CHUNK_DEVICE)
        codes = [self._nearest_rows(block, embed_t)[:count] for _, count, block in blocks]
        return torch.cat(codes).view(batch, frames)

    def _nearest_rows(self, x: torch.Tensor, embed_t: torch.Tensor) -> torch.Tensor:
        dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ embed_t + self.embed_sq)
        return dist.max(dim=-1).indices

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """int codes [B, T] -> features [B, D, T] (the reference's codes_to_features)."""
        return F.embedding(codes, self.embed).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Vocos backbone with the WavTokenizer pre-net (ResNet + attention), and the iSTFT head
# ---------------------------------------------------------------------------------------------


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # spelled as in the reference (F.silu may round differently)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """GroupNorm -> swish -> conv k3, twice, plus identity (dropout is inactive in eval)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = group_norm(dim)
        self.conv1 = Conv1d(dim, dim, kernel_size=3, padding=1)
        self.norm2 = group_norm(dim)
        self.conv2 = Conv1d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over time with 1x1 conv projections."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = group_norm(dim)
        self.q = Conv1d(dim, dim, kernel_size=1)
        self.k = Conv1d(dim, dim, kernel_size=1)
        self.v = Conv1d(dim, dim, kernel_size=1)
        self.proj_out = Conv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        weights = torch.bmm(q.permute(0, 2, 1), k) * (int(q.shape[1]) ** (-0.5))
        weights = torch.softmax(weights, dim=2)
        h = torch.bmm(v, weights.permute(0, 2, 1))
        return x + self.proj_out(h)


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, then a per-condition scale and shift (row `cond` of two tables)."""

    def __init__(self, num_embeddings: int, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.scale = nn.Embedding(num_embeddings, dim)
        self.shift = nn.Embedding(num_embeddings, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x, (self.dim,), eps=self.eps)
        return x * self.scale(cond) + self.shift(cond)


def channel_norm(dim: int, adanorm_embeddings: int | None) -> nn.Module:
    return AdaLayerNorm(adanorm_embeddings, dim) if adanorm_embeddings else nn.LayerNorm(dim, eps=1e-6)


def apply_norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    return norm(x, cond) if isinstance(norm, AdaLayerNorm) else norm(x)


class ConvNeXtBlock(nn.Module):
    """Depthwise conv k7 -> (Ada)LayerNorm -> Linear -> GELU -> Linear -> layer scale, plus identity."""

    def __init__(self, dim: int, intermediate_dim: int, adanorm_embeddings: int | None):
        super().__init__()
        self.dwconv = Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = channel_norm(dim, adanorm_embeddings)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = apply_norm(self.norm, self.dwconv(x).transpose(1, 2), cond)
        h = self.gamma * self.pwconv2(self.act(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class VocosBackbone(nn.Module):
    """Features [B, 512, T] -> hidden [B, T, dim]: embed conv, pre-net, norm, ConvNeXt blocks, LayerNorm."""

    def __init__(self, input_channels: int, dim: int, intermediate_dim: int, num_layers: int,
                 adanorm_embeddings: int | None):
        super().__init__()
        self.embed = Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = channel_norm(dim, adanorm_embeddings)
        self.convnext = nn.ModuleList(ConvNeXtBlock(dim, intermediate_dim, adanorm_embeddings)
                                      for _ in range(num_layers))
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)
        self.pos_net = nn.Sequential(ResnetBlock(dim), ResnetBlock(dim), AttnBlock(dim),
                                     ResnetBlock(dim), ResnetBlock(dim), group_norm(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = self.pos_net(self.embed(x))
        x = apply_norm(self.norm, x.transpose(1, 2), cond).transpose(1, 2)
        for block in self.convnext:
            x = block(x, cond)
        return self.final_layer_norm(x.transpose(1, 2))


class ISTFT(nn.Module):
    """Inverse STFT with "same" padding: T frames -> T * hop samples (irfft, window, overlap-add)."""

    def __init__(self, n_fft: int, hop_length: int):
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        frames = spec.shape[-1]
        pad = (self.n_fft - self.hop_length) // 2
        size = (frames - 1) * self.hop_length + self.n_fft
        fold = dict(output_size=(1, size), kernel_size=(1, self.n_fft), stride=(1, self.hop_length))
        ifft = torch.fft.irfft(spec, self.n_fft, dim=1, norm="backward") * self.window[None, :, None]
        y = F.fold(ifft, **fold)[:, 0, 0, pad:-pad]
        window_sq = self.window.square().expand(1, frames, -1).transpose(1, 2)
        envelope = F.fold(window_sq, **fold).squeeze()[pad:-pad]
        return y / envelope


class ISTFTHead(nn.Module):
    """hidden [B, T, dim] -> waveform [B, T * hop]: linear to log-magnitude and phase, then iSTFT."""

    def __init__(self, dim: int, n_fft: int, hop_length: int):
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)
        self.istft = ISTFT(n_fft, hop_length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mag, phase = self.out(x).transpose(1, 2).chunk(2, dim=1)
        mag = torch.clip(torch.exp(mag), max=1e2)  # the reference's guard against huge magnitudes
        return self.istft(mag * (torch.cos(phase) + 1j * torch.sin(phase)))
