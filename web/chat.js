// The conversation as chat bubbles, one per item: user turns (spoken, typed, or a camera frame from
// `camera.js`), assistant replies, tool calls (`tools.js`) and notices (errors, barge-ins). Each bubble is
// keyed by the server's item id so later events (a transcript arriving, a truncation) update it in place.
// `entries` mirrors the bubbles for tests.

export class Chat {
  constructor(list) {
    this.list = list;
    this.entries = []; // {id, role, text, state}
    this.bubbles = new Map(); // id -> {entry, element, body, meta}
  }

  // The bubble for `id`, created at the end when new.
  bubble(id, role) {
    let bubble = this.bubbles.get(id);
    if (bubble) return bubble;
    const entry = { id, role, text: "", state: "" };
    const element = document.createElement("li");
    element.className = `bubble ${role}`;
    element.dataset.role = role;
    const body = document.createElement("p");
    body.className = "text";
    const meta = document.createElement("p");
    meta.className = "meta";
    element.append(body, meta);
    this.list.append(element);
    bubble = { entry, element, body, meta };
    this.bubbles.set(id, bubble);
    this.entries.push(entry);
    return bubble;
  }

  // `text` replaces the bubble's text (undefined leaves it); `state` is a short note under it.
  update(id, role, { text, append, state } = {}) {
    const bubble = this.bubble(id, role);
    if (append) bubble.entry.text += append;
    if (text !== undefined) bubble.entry.text = text;
    if (state !== undefined) bubble.entry.state = state;
    bubble.body.textContent = bubble.entry.text.trimStart(); // NOTE: text deltas start with their space
    bubble.meta.textContent = bubble.entry.state;
    bubble.element.classList.toggle("pending", !bubble.entry.text);
    this.list.lastElementChild?.scrollIntoView({ block: "end" });
    return bubble.entry;
  }

  // An image above the bubble's text (a camera frame the user sent); `src` a data URL (the page's CSP allows those).
  picture(id, role, src, alt) {
    const bubble = this.bubble(id, role);
    const image = document.createElement("img");
    image.className = "picture";
    image.src = src;
    image.alt = alt;
    bubble.element.insertBefore(image, bubble.body);
    bubble.element.classList.add("with-picture");
  }

  has(id) {
    return this.bubbles.has(id);
  }

  textOf(id) {
    return this.bubbles.get(id)?.entry.text ?? "";
  }

  mark(id, className) {
    this.bubbles.get(id)?.element.classList.add(className);
  }

  notice(text) {
    this.update(`notice-${this.entries.length}`, "notice", { text });
  }
}
