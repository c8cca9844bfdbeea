// A camera frame into the conversation (the `image` message of `/ws`), where the session's pipeline sees
// (`session.started.images`): the "📷 send camera frame" button grabs one frame, sends it as a JPEG data URL
// with the text box's words if any (then the model replies; without words it waits, as the user asks by
// voice next) and shows it in the chat as the user's. One camera stream serves the whole session (one
// permission prompt, one warm-up), stopped with it. Nothing here throws: a denied or missing camera, or the
// server refusing the frame, is a notice in the chat. `images` mirrors what was sent, for tests:
// {bytes (the JPEG's), width, height, text, status, itemId}.

// NOTE: the model's processor resizes any frame to its own grid anyway; 1024 px keeps the detail it can
// use and the message small (the server closes a session on a message over `--max-message-bytes`, 1 MiB
// by default: a busy scene is re-encoded at lower quality until its data URL fits well under that).
const MAX_SIDE = 1024;
const QUALITIES = [0.85, 0.7, 0.5];
const MAX_DATA_URL_CHARS = 900_000;
// NOTE: a webcam's first frames are often dark while its auto-exposure settles.
const WARM_UP_MS = 300;
const CONSTRAINTS = { video: { width: { ideal: 1280 }, height: { ideal: 720 } }, audio: false };

const TITLES = {
  idle: "Start a session first",
  blind: "This server's pipeline does not see images (its entry stage runs no vision encoder)",
  busy: "Sending a frame…",
  ready: "Send one frame of your camera, with the text box's words if any (then the model replies to both)",
};

export class DemoCamera {
  // `button`: the camera button; `textBox`: the composer's input; `session()`: the running session or null.
  constructor(chat, button, textBox, session) {
    this.chat = chat;
    this.button = button;
    this.textBox = textBox;
    this.session = session;
    this.images = [];
    this.pending = []; // sent, not yet committed by the server, in the order sent: {image, id}
    this.stream = null;
    this.video = null;
    this.isSeeing = false;
    this.isBusy = false;
    this.generation = 0; // NOTE: bumped by `stop`, so a grab that outlives its session is dropped
    button.addEventListener("click", () => this.send());
    this.refresh();
  }

  refresh() {
    const why = !this.session() ? "idle" : !this.isSeeing ? "blind" : this.isBusy ? "busy" : "ready";
    this.button.disabled = why !== "ready";
    this.button.title = TITLES[why];
  }

  onStarted(started) {
    this.isSeeing = started.images === true;
    this.refresh();
  }

  // The session ended: the camera goes off (its light with it), and what was in flight was never committed.
  stop() {
    this.generation += 1;
    this.stream?.getTracks().forEach((track) => track.stop());
    this.stream = null;
    this.video = null;
    this.isSeeing = false;
    this.isBusy = false;
    for (const { image } of this.pending.splice(0)) image.status = "not committed: the session closed";
    this.refresh();
  }

  async send() {
    if (!this.isSeeing || this.isBusy) return;
    this.isBusy = true;
    this.refresh();
    const generation = this.generation;
    try {
      const frame = await this.grab(generation);
      const session = this.session();
      if (!frame || generation !== this.generation || !session) return;
      const text = this.textBox.value.trim();
      const image = { bytes: frame.bytes, width: frame.width, height: frame.height, text, status: "sending",
        itemId: null };
      // NOTE: with words the user asked about the frame: reply now; without, they ask by voice next.
      if (!session.sendImage(frame.dataUrl, text, text !== "")) return;
      if (text) this.textBox.value = "";
      this.images.push(image);
      const id = `image-${this.images.length}`;
      this.pending.push({ image, id });
      this.chat.picture(id, "user", frame.dataUrl, `camera frame, ${frame.width}×${frame.height}`);
      this.chat.update(id, "user", { text, state: "sending…" });
    } catch (error) {
      if (generation === this.generation) this.chat.notice(`no camera frame sent (${error.name}: ${error.message})`);
    } finally {
      if (generation === this.generation) this.isBusy = false;
      this.refresh();
    }
  }

  // One frame, scaled and encoded: {dataUrl, bytes, width, height}; null when the session ended meanwhile.
  async grab(generation) {
    if (!this.stream?.active) {
      if (!navigator.mediaDevices?.getUserMedia) throw new TypeError("no camera API here (HTTPS or localhost only)");
      const stream = await navigator.mediaDevices.getUserMedia(CONSTRAINTS);
      const video = document.createElement("video");
      video.muted = true;
      video.playsInline = true;
      video.srcObject = stream;
      try {
        await video.play();
        await new Promise((resolve) => setTimeout(resolve, WARM_UP_MS));
      } finally {
        if (generation !== this.generation) stream.getTracks().forEach((track) => track.stop());
      }
      if (generation !== this.generation) return null;
      this.stream = stream;
      this.video = video;
    }
    const { videoWidth, videoHeight } = this.video;
    if (!videoWidth || !videoHeight) throw new Error("the camera gave no picture");
    const scale = Math.min(1, MAX_SIDE / Math.max(videoWidth, videoHeight));
    const canvas = document.createElement("canvas");
    canvas.width = Math.round(videoWidth * scale);
    canvas.height = Math.round(videoHeight * scale);
    canvas.getContext("2d").drawImage(this.video, 0, 0, canvas.width, canvas.height);
    let dataUrl = "";
    for (const quality of QUALITIES) {
      dataUrl = canvas.toDataURL("image/jpeg", quality);
      if (dataUrl.length <= MAX_DATA_URL_CHARS) break;
    }
    if (dataUrl.length > MAX_DATA_URL_CHARS) throw new RangeError("the frame is too large, even at low quality");
    const base64 = dataUrl.slice(dataUrl.indexOf(",") + 1);
    const bytes = (base64.length * 3) / 4 - (base64.endsWith("==") ? 2 : base64.endsWith("=") ? 1 : 0);
    return { dataUrl, bytes, width: canvas.width, height: canvas.height };
  }

  // Handle what is about the frames sent; true when the event was only that. The server commits each
  // `image` message, or refuses it with an `error` whose message starts "image:", in the order they were sent.
  // A frame's `input_committed` is the next one that holds images (`images`: their count).
  onEvent(event) {
    const next = this.pending[0];
    if (!next) return false;
    if (event.type === "input_committed" && event.images > 0) {
      this.pending.shift();
      next.image.status = "committed";
      next.image.itemId = event.item_id;
      const { width, height, bytes } = next.image;
      this.chat.update(next.id, "user", { state: `camera frame, ${width}×${height}, ${Math.ceil(bytes / 1024)} KiB` });
      return true;
    }
    if (event.type === "error" && event.message?.startsWith("image:")) {
      this.pending.shift();
      next.image.status = `refused: ${event.code}`;
      this.chat.update(next.id, "user", { state: `not accepted (${event.code})` });
      this.chat.mark(next.id, "failed");
    }
    return false; // NOTE: an error still shows as a notice
  }
}
