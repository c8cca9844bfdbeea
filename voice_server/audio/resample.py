"""Streaming rational resampling (polyphase windowed-sinc FIR) between 8, 16, 22.05, 24, 44.1 and 48 kHz.

Quality (fixed, the same for every rate pair): a linear-phase low-pass with a Kaiser window, designed at
the up-sampled rate ``L * rate_in`` (``L / M = rate_out / rate_in`` reduced by their gcd):

- passband flat to ``0.45 * min(rate_in, rate_out)`` (ripple far below 0.01 dB);
- stopband from ``0.5 * min(rate_in, rate_out)`` (the lower rate's Nyquist) down by >= 60 dB (designed
  for 65 dB), so a tone above the target Nyquist does not alias and images of the input are removed.

Latency: the filter is symmetric about tap ``D``, a multiple of ``M``, so the group delay is a whole
number of output samples, ``delay_out = D / M`` (``ResamplerSpec.delay_out``); for every pair of
8/16/24/48 kHz ``D`` is a multiple of ``L`` too, so ``delay_in = D / L`` is whole as well. It is about
40 samples of the lower rate (5 ms with 8 kHz on one side, 2.5 ms with 16 kHz, ~0.9 ms for
44.1 <-> 48 kHz); e.g. 48k -> 16k: 40 out / 120 in; 24k -> 8k: 40 out; 8k -> 24k: 120 out;
16k -> 24k: 60 out.

Lengths: after ``N`` input samples in total, ``process`` has returned ``ceil(N * L / M)`` samples (every
output whose newest input sample has arrived); ``flush`` returns the last ``delay_out`` so the stream
totals ``ceil(N * L / M) + delay_out``; dropping the first ``delay_out`` leaves ``ceil(N * L / M)``
samples aligned with the input (``resample_signal`` does exactly that for a whole signal).

Streaming is bit-exact: any split of the input into chunks (empty and 1-sample chunks included) gives
the same output as one call, because each output is computed by the same elementwise float32
operations in the same order (a fixed-shape pairwise sum over the taps, never a BLAS dot product,
whose summation order may depend on the batch).

Cost (numpy, one thread, the best of 5 runs of 1000 consecutive 20 ms chunks on a 2-vCPU EPYC, 2026-12-04):
8k -> 16k 58 us per chunk (160 in, 320 out), 24k -> 8k 49 us, 16k -> 24k 78 us, 48k -> 16k 78 us,
24k -> 16k 67 us: 0.71-0.79x of gathering each output's window and phase (which 44.1k -> 48k, with 160
phases, still does: 181 us), and at most ~1% of the 20 ms a chunk lasts. The G.711 lookups cost a few
microseconds per 160-sample frame.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from voice_server.audio.pcm import float32_to_pcm16, pcm16_to_float32

__all__ = ["SUPPORTED_RATES", "AlignedResampler", "ResamplerSpec", "StreamResampler", "resample_signal"]

# NOTE: 22.05 kHz is the rate of Piper `medium` voices (the talker's opt-in engine).
SUPPORTED_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
PASSBAND_FRACTION = 0.45  # of min(rate_in, rate_out)
STOPBAND_FRACTION = 0.5  # of min(rate_in, rate_out): the lower rate's Nyquist
# NOTE: products held at once; long inputs run in blocks of outputs so memory stays ~4 MB.
_MAX_BLOCK_PRODUCTS = 1 << 20
DESIGN_ATTENUATION_DB = 65.0  # NOTE: 5 dB over the 60 dB promised: Kaiser's length formula is approximate
MAX_STRIDED_UP = 8
"""Pairs with at most this many phases (every pair of 8/16/24/48 kHz) run a phase at a time on strided views;
more (44.1 <-> 48 kHz: 160) would make that a numpy call per output or two, so each output's window is
gathered instead."""


@dataclass(frozen=True)
class ResamplerSpec:
    """The rational structure and filter size of one rate pair (all counts are samples)."""

    rate_in: int
    rate_out: int
    up: int  # L
    down: int  # M
    taps_per_phase: int  # K: each output is a K-term dot product
    center_tap: int  # D: the prototype's symmetry point, at the up-sampled rate

    @property
    def delay_out(self) -> int:
        """Group delay in output samples."""
        return self.center_tap // self.down

    @property
    def delay_in(self) -> float:
        """Group delay in input samples (whole for every pair of 8/16/24/48 kHz)."""
        return self.center_tap / self.up

    def num_output(self, num_input: int) -> int:
        """Samples ``process`` has returned after ``num_input`` input samples: ``ceil(N * L / M)``."""
        return -(-num_input * self.up // self.down)

    @classmethod
    def for_rates(cls, rate_in: int, rate_out: int) -> ResamplerSpec:
        """The spec for a supported pair; ValueError naming the bad rate otherwise."""
        for name, rate in (("rate_in", rate_in), ("rate_out", rate_out)):
            if isinstance(rate, bool) or not isinstance(rate, int) or rate not in SUPPORTED_RATES:
                raise ValueError(f"{name} must be one of {SUPPORTED_RATES} Hz, got {rate!r}")
        if rate_in == rate_out:
            return cls(rate_in, rate_out, 1, 1, 1, 0)  # NOTE: a single unit tap: a copy, no delay
        gcd = math.gcd(rate_in, rate_out)
        up, down = rate_out // gcd, rate_in // gcd
        rate_up = up * rate_in
        transition = (STOPBAND_FRACTION - PASSBAND_FRACTION) * min(rate_in, rate_out)
        # NOTE: Kaiser's estimate of the filter length for an attenuation and a transition width.
        num_taps_min = (DESIGN_ATTENUATION_DB - 7.95) / (2.285 * 2 * math.pi * transition / rate_up) + 1
        # NOTE: D a multiple of M makes the delay whole in output samples; of L too (when that stays
        # short: every pair of 8/16/24/48 kHz) makes it whole in input samples as well.
        unit = up * down if up * down <= 16 else down
        center_tap = math.ceil(math.ceil((num_taps_min - 1) / 2) / unit) * unit
        taps_per_phase = -(-(2 * center_tap + 1) // up)
        return cls(rate_in, rate_out, up, down, taps_per_phase, center_tap)


@functools.lru_cache(maxsize=32)
def _phase_filters(spec: ResamplerSpec) -> npt.NDArray[np.float32]:
    """(L, K) float32 coefficients; row p, column j multiplies input ``i0 - (K - 1 - j)`` for phase p.

    Equal rates get the single tap 1.0. Otherwise the prototype is a Kaiser-windowed sinc at the
    up-sampled rate, cut off midway through the transition band, with gain L (zero-stuffing by L
    divides the signal's level by L).
    """
    num_taps = 2 * spec.center_tap + 1
    if num_taps == 1:
        return np.ones((1, 1), dtype=np.float32)
    rate_up = spec.up * spec.rate_in
    cutoff = 0.5 * (PASSBAND_FRACTION + STOPBAND_FRACTION) * min(spec.rate_in, spec.rate_out) / rate_up
    beta = 0.1102 * (DESIGN_ATTENUATION_DB - 8.7)
    offsets = np.arange(num_taps, dtype=np.float64) - spec.center_tap
    prototype = 2 * cutoff * np.sinc(2 * cutoff * offsets) * np.kaiser(num_taps, beta) * spec.up
    padded = np.zeros(spec.taps_per_phase * spec.up, dtype=np.float64)
    padded[:num_taps] = prototype
    # NOTE: tap p + k*L belongs to phase p and multiplies x[i0 - k]; reverse k so a window reads forward.
    filters = padded.reshape(spec.taps_per_phase, spec.up).T[:, ::-1].astype(np.float32)
    filters.setflags(write=False)
    return filters


def _pairwise_sum(products: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Row sums of a (n, K) array by halving K in a fixed pattern, so a row's result never depends on n."""
    while products.shape[1] > 1:
        width = products.shape[1]
        half = width // 2
        summed = products[:, :half] + products[:, half : 2 * half]
        if width % 2:
            summed[:, 0] += products[:, 2 * half]
        products = summed
    return products[:, 0]


class StreamResampler:
    """Resamples one mono stream chunk by chunk, keeping the filter's history between calls.

    ``process`` takes float samples (1-D, any float dtype, computed and returned as float32);
    ``process_int16`` is the same for int16 PCM (scaled by 1/32768, rounded and clipped back).
    ``flush`` returns the tail and resets the resampler for a new stream.
    """

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.spec = ResamplerSpec.for_rates(rate_in, rate_out)
        self._filters = _phase_filters(self.spec)
        self.reset()

    def reset(self) -> None:
        """Forget the stream: the next sample is input sample 0 (preceded by silence)."""
        taps = self.spec.taps_per_phase
        self._history = np.zeros(taps - 1, dtype=np.float32)
        self._history_start = -(taps - 1)  # input index of _history[0]
        self._num_in = 0
        self._num_out = 0

    @property
    def num_input(self) -> int:
        """Input samples taken since the last reset."""
        return self._num_in

    @property
    def num_output(self) -> int:
        """Output samples returned since the last reset."""
        return self._num_out

    def process(self, samples: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        """float32 output samples for the next chunk of float input (1-D, possibly empty)."""
        if not isinstance(samples, np.ndarray) or samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
            got = f"{samples.dtype} array of shape {samples.shape}" if isinstance(samples, np.ndarray) else type(
                samples
            ).__name__
            raise ValueError(f"samples must be a 1-D float numpy array (use process_int16 for PCM16), got {got}")
        return self._run(samples.astype(np.float32, copy=False), self.spec.num_output(self._num_in + len(samples)))

    def process_int16(self, samples: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        """int16 output for the next chunk of int16 PCM (1-D, possibly empty)."""
        return float32_to_pcm16(self.process(pcm16_to_float32(samples)))

    def flush(self) -> npt.NDArray[np.float32]:
        """The last ``delay_out`` float32 samples (the filter's tail over trailing silence); then resets."""
        spec = self.spec
        num_zeros = -(-spec.center_tap // spec.up)  # input samples of silence that reach every tail output
        tail = self._run(np.zeros(num_zeros, dtype=np.float32), spec.num_output(self._num_in) + spec.delay_out)
        self.reset()
        return tail

    def flush_int16(self) -> npt.NDArray[np.int16]:
        """``flush`` as int16 PCM."""
        return float32_to_pcm16(self.flush())

    def _run(self, chunk: npt.NDArray[np.float32], num_out_total: int) -> npt.NDArray[np.float32]:
        spec = self.spec
        taps = spec.taps_per_phase
        history = np.concatenate((self._history, chunk)) if len(chunk) else self._history
        self._num_in += len(chunk)
        out = np.empty(num_out_total - self._num_out, dtype=np.float32)
        block_len = max(1, _MAX_BLOCK_PRODUCTS // taps)
        for block_start in range(0, len(out), block_len):
            block_end = min(block_start + block_len, len(out))
            if spec.up <= MAX_STRIDED_UP:
                self._run_phases(history, self._num_out + block_start, out[block_start:block_end])
            else:
                self._run_gathered(history, self._num_out + block_start, out[block_start:block_end])
        self._num_out = num_out_total
        # NOTE: keep from the oldest sample the next output can read (never past what has arrived).
        next_newest = self._num_out * spec.down // spec.up
        keep_from = min(next_newest - (taps - 1), self._num_in - (taps - 1))
        self._history = history[keep_from - self._history_start :].copy()
        self._history_start = keep_from
        return out

    def _run_phases(self, history: npt.NDArray[np.float32], first: int, out: npt.NDArray[np.float32]) -> None:
        """Outputs ``first..`` into ``out``, one phase at a time: outputs ``L`` apart share a phase and read
        windows ``M`` input samples apart, so each phase's windows are a strided view of the history (no
        gather of windows or coefficients), multiplied into its rows of one product array that is summed
        once. The products and sums are the gathered path's, bit for bit."""
        spec = self.spec
        taps, itemsize = spec.taps_per_phase, history.itemsize
        products = np.empty((len(out), taps), dtype=np.float32)
        for offset in range(min(spec.up, len(out))):
            position = (first + offset) * spec.down
            rows = products[offset :: spec.up]
            oldest = position // spec.up - (taps - 1) - self._history_start
            windows = np.ndarray(rows.shape, np.float32, history, oldest * itemsize, (spec.down * itemsize, itemsize))
            np.multiply(windows, self._filters[position % spec.up], out=rows)
        out[:] = _pairwise_sum(products)

    def _run_gathered(self, history: npt.NDArray[np.float32], first: int, out: npt.NDArray[np.float32]) -> None:
        """Outputs ``first..`` into ``out``, each output's window and phase gathered (many phases)."""
        spec = self.spec
        taps = spec.taps_per_phase
        positions = np.arange(first, first + len(out), dtype=np.int64) * spec.down
        newest = positions // spec.up  # the newest input sample each output reads
        windows = sliding_window_view(history, taps)[newest - (taps - 1) - self._history_start]
        out[:] = _pairwise_sum(windows * self._filters[positions % spec.up])


class AlignedResampler:
    """A `StreamResampler` whose output starts at input sample 0: the filter's first ``delay_out`` outputs
    (which precede it) are dropped, so output sample i lies at ``i / rate_out`` s on the input's timeline; the
    input's last ``delay_out`` outputs' worth comes out with the next chunk."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self._resampler = StreamResampler(rate_in, rate_out)
        self.spec = self._resampler.spec
        self._num_to_drop = self.spec.delay_out

    def process(self, samples: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        """float32 output for the next chunk of float input (as `StreamResampler.process`), aligned."""
        out = self._resampler.process(samples)
        if self._num_to_drop:
            num_dropped = min(self._num_to_drop, out.size)
            out, self._num_to_drop = out[num_dropped:], self._num_to_drop - num_dropped
        return out


def resample_signal(samples: npt.NDArray[np.floating], rate_in: int, rate_out: int) -> npt.NDArray[np.float32]:
    """A whole float signal at ``rate_out``: ``ceil(N * L / M)`` float32 samples, the delay removed."""
    resampler = StreamResampler(rate_in, rate_out)
    out = np.concatenate((resampler.process(samples), resampler.flush()))
    return out[resampler.spec.delay_out :]
