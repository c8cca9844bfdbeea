// The native protocol, `WS /ws` (docs/PROTOCOLS.md): a session.start first, then binary PCM16 frames
// of microphone audio and JSON control messages; the server answers with JSON events and binary PCM16
// frames of reply audio at the output rate.

export class NativeSession {
  // `handlers`: onOpen(startedEvent), onEvent(event), onAudio(ArrayBuffer), onClose(code, reason).
  constructor(url, start, handlers) {
    this.handlers = handlers;
    this.isStarted = false;
    this.ws = new WebSocket(url);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => this.ws.send(JSON.stringify({ type: "session.start", ...start }));
    this.ws.onmessage = (message) => this.onMessage(message.data);
    // NOTE: a refused session is closed with a code and reason (1008 policy, 1013 not ready or full);
    // an `error` event carries nothing useful, the close that follows does.
    this.ws.onclose = (event) => handlers.onClose(event.code, event.reason);
  }

  static urlFor(location) {
    return `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws`;
  }

  onMessage(data) {
    if (data instanceof ArrayBuffer) {
      this.handlers.onAudio(data);
      return;
    }
    const event = JSON.parse(data);
    if (event.type === "session.started") {
      this.isStarted = true;
      this.handlers.onOpen(event);
      return;
    }
    this.handlers.onEvent(event);
  }

  get isOpen() {
    return this.isStarted && this.ws.readyState === WebSocket.OPEN;
  }

  sendAudio(pcm16Buffer) {
    if (this.isOpen) this.ws.send(pcm16Buffer);
    return this.isOpen;
  }

  send(message) {
    if (this.isOpen) this.ws.send(JSON.stringify(message));
    return this.isOpen;
  }

  sendText(text) {
    return this.send({ type: "text", text, respond: true });
  }

  cancelResponse() {
    return this.send({ type: "response.cancel" });
  }

  // A tool call's output (`call_id` from its `tool_call`); `respond` asks for the next response.
  sendToolResult(callId, output, respond) {
    return this.send({ type: "tool_result", call_id: callId, output, respond });
  }

  // A user item with an image (a PNG or JPEG data URL) and `text` (may be empty); `respond` asks for a response.
  sendImage(dataUrl, text, respond) {
    return this.send({ type: "image", image: dataUrl, text, respond });
  }

  reportPlayback(playedMs) {
    return this.send({ type: "playback", played_ms: Math.max(0, Math.floor(playedMs)) });
  }

  close(reason) {
    if (this.ws.readyState === WebSocket.CONNECTING || this.ws.readyState === WebSocket.OPEN) {
      this.ws.close(1000, reason);
    }
  }
}
