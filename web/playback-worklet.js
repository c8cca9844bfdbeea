// Reply playback on the audio thread: a ring buffer of float samples at the context's rate (24 kHz),
// fed by the main thread ("push"), emptied at once on barge-in ("flush"), held while speech over the reply
// is judged ("pause" until "resume": nothing is consumed, silence is rendered).
//
// It counts, in samples of the reply stream: `position`, how far the stream has been consumed
// (played or flushed), and `played`, how much actually reached the speakers. The main thread turns
// these into the `playback` {played_ms} reports the server uses to cut an interrupted reply to what
// the user heard. Reports go out every few render quanta while audio plays, and once when it stops.

const REPORT_EVERY_QUANTA = 8; // 8 x 128 samples at 24 kHz: about every 43 ms

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.ring = new Float32Array(options.processorOptions.capacity);
    this.readIndex = 0;
    this.size = 0; // samples buffered
    this.position = 0;
    this.played = 0;
    this.numDropped = 0; // samples that did not fit (the main thread keeps the ring from filling)
    this.quanta = 0;
    this.wasPlaying = false;
    this.isPaused = false;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(message) {
    if (message.type === "push") {
      this.write(message.samples);
    } else if (message.type === "pause" || message.type === "resume") {
      this.isPaused = message.type === "pause";
      this.report();
    } else if (message.type === "flush") {
      this.isPaused = false; // NOTE: a flush ends the reply; the next one plays at once
      // NOTE: what was buffered counts as consumed (the stream moved past it) but not as played;
      // `heard` is the position the speakers had reached.
      const heard = this.position;
      this.position += this.size;
      this.size = 0;
      this.port.postMessage({ type: "flushed", heard, position: this.position, played: this.played });
    }
  }

  write(samples) {
    const capacity = this.ring.length;
    const count = Math.min(samples.length, capacity - this.size);
    this.numDropped += samples.length - count;
    let writeIndex = (this.readIndex + this.size) % capacity;
    for (let i = 0; i < count; i++) {
      this.ring[writeIndex] = samples[i];
      writeIndex = writeIndex + 1 === capacity ? 0 : writeIndex + 1;
    }
    this.size += count;
  }

  report() {
    this.port.postMessage({
      type: "state", position: this.position, played: this.played, buffered: this.size,
      dropped: this.numDropped,
    });
  }

  process(_inputs, outputs) {
    const output = outputs[0];
    const first = output[0];
    const count = this.isPaused ? 0 : Math.min(first.length, this.size);
    const capacity = this.ring.length;
    for (let i = 0; i < count; i++) {
      first[i] = this.ring[this.readIndex];
      this.readIndex = this.readIndex + 1 === capacity ? 0 : this.readIndex + 1;
    }
    first.fill(0, count);
    for (let c = 1; c < output.length; c++) output[c].set(first);
    this.size -= count;
    this.position += count;
    this.played += count;
    const isPlaying = count > 0;
    this.quanta += 1;
    if ((isPlaying && this.quanta % REPORT_EVERY_QUANTA === 0) || isPlaying !== this.wasPlaying) this.report();
    this.wasPlaying = isPlaying;
    return true;
  }
}

registerProcessor("playback-processor", PlaybackProcessor);
