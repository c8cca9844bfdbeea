// Microphone capture on the audio thread: mono, resampled from the context's rate to the session's
// input rate, cut into fixed frames of PCM16 and posted (transferred) to the main thread, which sends
// each one as a binary WebSocket frame.
//
// NOTE: the resampling is here rather than in an AudioContext at the input rate: Firefox refuses to
// connect a microphone to a context whose rate differs from the device's, and Chrome's own
// resampling of a MediaStream is not specified; doing it here works the same everywhere.

// A windowed-sinc low-pass (Blackman), unity gain at DC: the anti-aliasing filter before decimation.
function lowPass(cutoff, numTaps) {
  const taps = new Float32Array(numTaps);
  const mid = (numTaps - 1) / 2;
  let sum = 0;
  for (let i = 0; i < numTaps; i++) {
    const x = i - mid;
    const sinc = x === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * x) / (Math.PI * x);
    const window = 0.42 - 0.5 * Math.cos((2 * Math.PI * i) / (numTaps - 1)) + 0.08 * Math.cos((4 * Math.PI * i) / (numTaps - 1));
    taps[i] = sinc * window;
    sum += taps[i];
  }
  for (let i = 0; i < numTaps; i++) taps[i] /= sum;
  return taps;
}

// Streaming resampler: low-pass (when going down) then linear interpolation between filtered samples.
// NOTE: no allocation per render quantum (the audio thread must not wait on the garbage collector):
// input accumulates in one growable buffer, outputs go to a callback.
class Resampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    // NOTE: cutoff at 90% of the output's Nyquist frequency, in cycles per input sample.
    this.taps = this.step > 1 ? lowPass(0.45 / this.step, 16 * Math.ceil(this.step) + 1) : new Float32Array([1]);
    this.half = (this.taps.length - 1) / 2;
    this.buf = new Float32Array(this.taps.length + 1024);
    this.len = this.taps.length - 1; // starts with `taps - 1` samples of silence as history
    this.pos = this.half; // the next output's position in `buf` (fractional)
  }

  filtered(i) {
    const { taps, buf } = this;
    let acc = 0;
    const start = i - this.half;
    for (let k = 0; k < taps.length; k++) acc += taps[k] * buf[start + k];
    return acc;
  }

  process(input, emit) {
    if (this.len + input.length > this.buf.length) {
      const grown = new Float32Array(2 * (this.len + input.length));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
    this.buf.set(input, this.len);
    this.len += input.length;
    while (Math.floor(this.pos) + 1 + this.half < this.len) {
      const i = Math.floor(this.pos);
      const frac = this.pos - i;
      const a = this.filtered(i);
      emit(frac === 0 ? a : a + frac * (this.filtered(i + 1) - a));
      this.pos += this.step;
    }
    const drop = Math.min(this.len, Math.max(0, Math.floor(this.pos) - this.half));
    this.buf.copyWithin(0, drop, this.len);
    this.len -= drop;
    this.pos -= drop;
  }
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate, frameMs } = options.processorOptions;
    this.resampler = new Resampler(sampleRate, targetRate);
    this.frameLength = Math.round((targetRate * frameMs) / 1000);
    this.frame = new Int16Array(this.frameLength);
    this.filled = 0;
    this.sumSquares = 0; // over the frame being filled: its level for the meter
    this.emit = (value) => this.add(value);
  }

  add(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff;
    this.sumSquares += clipped * clipped;
    if (this.filled === this.frameLength) {
      const level = Math.sqrt(this.sumSquares / this.frameLength);
      // NOTE: transferred, not copied: the old frame is detached (length 0) from here on.
      this.port.postMessage({ pcm: this.frame.buffer, level }, [this.frame.buffer]);
      this.frame = new Int16Array(this.frameLength);
      this.filled = 0;
      this.sumSquares = 0;
    }
  }

  process(inputs) {
    // NOTE: one channel: the node is created with channelCount 1 ("explicit"), so the graph downmixes.
    const mono = inputs[0]?.[0];
    if (!mono) return true; // NOTE: no input yet (or the track ended)
    this.resampler.process(mono, this.emit);
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
