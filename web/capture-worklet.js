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
class Resampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    // NOTE: cutoff at 90% of the output's Nyquist frequency, in cycles per input sample.
    this.taps = this.step > 1 ? lowPass(0.45 / this.step, 16 * Math.ceil(this.step) + 1) : new Float32Array([1]);
    this.half = (this.taps.length - 1) / 2;
    this.buf = new Float32Array(0); // input not yet consumed, with `half` samples of history
    this.pos = this.half; // the next output's position in `buf` (fractional)
    if (this.step > 1) this.buf = new Float32Array(this.taps.length - 1); // start from silence
  }

  filtered(i) {
    const { taps, buf } = this;
    let acc = 0;
    const start = i - this.half;
    for (let k = 0; k < taps.length; k++) acc += taps[k] * buf[start + k];
    return acc;
  }

  process(input) {
    const joined = new Float32Array(this.buf.length + input.length);
    joined.set(this.buf);
    joined.set(input, this.buf.length);
    this.buf = joined;
    const out = [];
    while (Math.floor(this.pos) + 1 + this.half < this.buf.length) {
      const i = Math.floor(this.pos);
      const frac = this.pos - i;
      const a = this.filtered(i);
      out.push(frac === 0 ? a : a + frac * (this.filtered(i + 1) - a));
      this.pos += this.step;
    }
    const drop = Math.max(0, Math.floor(this.pos) - this.half);
    this.buf = this.buf.slice(drop);
    this.pos -= drop;
    return out;
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
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true; // NOTE: no input yet (or the track ended)
    let mono = channels[0];
    if (channels.length > 1) {
      mono = new Float32Array(mono.length);
      for (const ch of channels) for (let i = 0; i < ch.length; i++) mono[i] += ch[i] / channels.length;
    }
    for (const value of this.resampler.process(mono)) {
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
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
