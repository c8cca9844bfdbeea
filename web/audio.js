// The main-thread side of the two worklets: the microphone (capture-worklet.js) and the reply
// player (playback-worklet.js). Each gets its AudioContext from the caller, which creates both in the
// Start click itself: a context created later (after the permission prompt, say) starts suspended.

export const OUTPUT_RATE = 24000;
const FRAME_MS = 20;
// NOTE: the ring holds a few seconds; the rest of a long reply waits here, on the main thread, so the
// ring never overflows however far generation runs ahead of real time.
const RING_SECONDS = 4;

const MIC_CONSTRAINTS = { audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 } };

// A context for the microphone: at the device's own rate (no sampleRate option); the worklet resamples.
export function microphoneContext() {
  return new AudioContext({ latencyHint: "interactive" });
}

// A context for the player, at the reply's rate: the browser resamples to the device.
export function playerContext() {
  return new AudioContext({ sampleRate: OUTPUT_RATE, latencyHint: "interactive" });
}

// Microphone -> PCM16 frames at `inputRate` (`onFrame(ArrayBuffer, level)`); closes `context` on failure.
export class Microphone {
  static async open(context, inputRate, onFrame) {
    let stream = null;
    try {
      stream = await navigator.mediaDevices.getUserMedia(MIC_CONSTRAINTS);
      await context.audioWorklet.addModule("capture-worklet.js");
      const source = context.createMediaStreamSource(stream);
      const node = new AudioWorkletNode(context, "capture-processor", {
        numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit",
        processorOptions: { targetRate: inputRate, frameMs: FRAME_MS },
      });
      node.port.onmessage = (event) => onFrame(event.data.pcm, event.data.level);
      source.connect(node);
      await context.resume();
      return new Microphone(stream, context, node);
    } catch (error) {
      stream?.getTracks().forEach((track) => track.stop());
      await context.close();
      throw error;
    }
  }

  constructor(stream, context, node) {
    this.stream = stream;
    this.context = context;
    this.node = node;
  }

  get label() {
    return this.stream.getAudioTracks()[0]?.label || "microphone";
  }

  async close() {
    this.node.port.onmessage = null;
    this.stream.getTracks().forEach((track) => track.stop());
    await this.context.close();
  }
}

// PCM16 reply audio -> the speakers, through the playback worklet's ring buffer.
//
// Positions are in samples of the reply stream since the player opened: `written` (received),
// `position` (consumed: played, or dropped by a flush) and `played` (rendered to the output device;
// its own output latency, a few tens of ms, is not subtracted).
export class Player {
  // Closes `context` on failure.
  static async open(context, onState) {
    try {
      await context.audioWorklet.addModule("playback-worklet.js");
      const node = new AudioWorkletNode(context, "playback-processor", {
        numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
        processorOptions: { capacity: RING_SECONDS * OUTPUT_RATE },
      });
      node.connect(context.destination);
      await context.resume();
      return new Player(context, node, onState);
    } catch (error) {
      await context.close();
      throw error;
    }
  }

  constructor(context, node, onState) {
    this.context = context;
    this.node = node;
    this.onState = onState;
    this.capacity = RING_SECONDS * OUTPUT_RATE;
    this.pending = []; // Float32Arrays not yet in the ring
    this.numPending = 0;
    this.written = 0;
    this.sentToRing = 0;
    this.skipped = 0; // pending samples a flush dropped before they reached the ring
    this.ringPosition = 0; // the worklet's `position`: ring samples played or flushed
    this.played = 0;
    this.buffered = 0;
    this.flushWaiters = [];
    node.port.onmessage = (event) => this.onMessage(event.data);
  }

  // NOTE: samples are skipped only by a flush, which also empties the ring, so every skipped sample
  // lies after every sample the ring consumed: the sum is the stream position.
  get position() {
    return this.ringPosition + this.skipped;
  }

  get isPlaying() {
    return this.numPending > 0 || this.sentToRing > this.ringPosition;
  }

  onMessage(message) {
    this.ringPosition = message.position;
    this.played = message.played;
    if (message.type === "flushed") {
      this.buffered = 0;
      const waiters = this.flushWaiters;
      this.flushWaiters = [];
      waiters.forEach((resolve) => resolve(message.heard));
    } else {
      this.buffered = message.buffered;
      this.pump();
    }
    this.onState(this);
  }

  push(pcm16Bytes) {
    const pcm = new Int16Array(pcm16Bytes);
    const samples = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 0x8000;
    this.pending.push(samples);
    this.numPending += samples.length;
    this.written += samples.length;
    this.pump();
    return samples.length;
  }

  // Move pending audio into the ring while it fits, judged by the worklet's last report (which can
  // only overstate how full the ring is).
  pump() {
    while (this.pending.length > 0) {
      const next = this.pending[0];
      if (next.length > this.capacity - (this.sentToRing - this.ringPosition)) return;
      this.pending.shift();
      this.numPending -= next.length;
      this.sentToRing += next.length;
      this.node.port.postMessage({ type: "push", samples: next }, [next.buffer]);
    }
  }

  // Hold playback where it is (nothing is dropped) until `resume`.
  pause() {
    this.node.port.postMessage({ type: "pause" });
  }

  resume() {
    this.node.port.postMessage({ type: "resume" });
  }

  // Stop at once, dropping everything not yet played. Resolves, once the worklet has emptied its ring,
  // with the stream position the speakers had reached.
  flush() {
    const skippedBefore = this.skipped;
    this.skipped += this.numPending;
    this.pending = [];
    this.numPending = 0;
    const done = new Promise((resolve) => this.flushWaiters.push(resolve));
    this.node.port.postMessage({ type: "flush" });
    return done.then((heardInRing) => heardInRing + skippedBefore);
  }

  async close() {
    this.node.port.onmessage = null;
    this.flushWaiters.forEach((resolve) => resolve(this.ringPosition));
    await this.context.close();
  }
}
