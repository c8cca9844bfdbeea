// First-audio latency per turn, as segmented bars on a canvas (no library): each bar is one response,
// split at each stage's first output (`response_done.timings_ms`: ms after the response started,
// per stage, plus `first_audio_sent`, the first byte, and `first_audible`, when the first audible
// frame is heard), so a bar shows where the wait before the reply was heard went.

const MAX_BARS = 24;
const SENT = "first_audio_sent";
const HEARD = "first_audible";
const NOT_STAGES = new Set([SENT, HEARD, "end_of_speech"]);
const SENT_COLOR = "#bab0ac";
const HEARD_COLOR = "#e15759";
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f"];

export class LatencyChart {
  constructor(canvas, legend, summary) {
    this.canvas = canvas;
    this.legend = legend;
    this.summary = summary;
    this.points = []; // {label, totalMs, segments: [{name, fromMs, toMs}]}
    this.colors = new Map(); // stage name -> color, in the order stages first appeared
    this.draw();
  }

  // Add a turn from its timings; returns the point, or null when the response sent no audio.
  add(label, timingsMs) {
    const sentMs = timingsMs?.[SENT];
    if (typeof sentMs !== "number") return null;
    const heardMs = timingsMs?.[HEARD];
    const totalMs = typeof heardMs === "number" ? Math.max(heardMs, sentMs) : sentMs;
    // NOTE: stages in the order they first produced output; each segment runs from the previous
    // milestone to this one, then to the first audio byte sent, then to the first audible frame heard
    // (a reply that opens with silence is heard later than it is sent).
    const stages = Object.entries(timingsMs)
      .filter(([name, ms]) => !NOT_STAGES.has(name) && typeof ms === "number")
      .sort((a, b) => a[1] - b[1]);
    const milestones = [...stages, [SENT, sentMs]];
    if (typeof heardMs === "number") milestones.push([HEARD, totalMs]);
    const segments = [];
    let fromMs = 0;
    for (const [name, ms] of milestones) {
      const toMs = Math.max(fromMs, Math.min(ms, totalMs));
      segments.push({ name, fromMs, toMs });
      fromMs = toMs;
    }
    const point = { label, totalMs, segments };
    this.points.push(point);
    if (this.points.length > MAX_BARS) this.points.shift();
    for (const { name } of segments) {
      if (!NOT_STAGES.has(name) && !this.colors.has(name)) this.colors.set(name, PALETTE[this.colors.size % PALETTE.length]);
    }
    this.draw();
    this.describe(point);
    return point;
  }

  describe(point) {
    const short = { [SENT]: "sent", [HEARD]: "heard" };
    const steps = point.segments.map((s) => `${short[s.name] ?? s.name} ${s.toMs.toFixed(0)}`).join(" → ");
    this.summary.textContent = `last first-audio latency: ${point.totalMs.toFixed(0)} ms (${steps} ms)`;
    const labels = { [SENT]: "to first audio sent", [HEARD]: "to first audible audio heard" };
    this.legend.replaceChildren(
      ...[...this.colors, [SENT, SENT_COLOR], [HEARD, HEARD_COLOR]].map(([name, color]) => {
        const item = document.createElement("li");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = color; // NOTE: a CSSOM property, which the page's CSP allows
        item.append(swatch, labels[name] ?? name);
        return item;
      }),
    );
  }

  draw() {
    const { canvas } = this;
    const scale = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 320;
    const height = canvas.clientHeight || 140;
    canvas.width = Math.round(width * scale);
    canvas.height = Math.round(height * scale);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(scale, 0, 0, scale, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 40;
    const bottom = height - 16;
    const top = 8;
    const maxMs = niceCeiling(Math.max(10, ...this.points.map((p) => p.totalMs)));
    const y = (ms) => bottom - ((bottom - top) * ms) / maxMs;
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#667";
    ctx.strokeStyle = "#dde";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const ms = (maxMs * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y(ms) + 0.5);
      ctx.lineTo(width, y(ms) + 0.5);
      ctx.stroke();
      ctx.fillText(`${ms.toFixed(0)}`, left - 4, y(ms));
    }
    if (this.points.length === 0) {
      ctx.textAlign = "center";
      ctx.fillText("no turns yet", (left + width) / 2, (top + bottom) / 2);
      return;
    }
    const slot = (width - left) / MAX_BARS;
    const barWidth = Math.max(4, slot * 0.7);
    this.points.forEach((point, i) => {
      const x = left + i * slot + (slot - barWidth) / 2;
      for (const seg of point.segments) {
        ctx.fillStyle = seg.name === SENT ? SENT_COLOR : seg.name === HEARD ? HEARD_COLOR : this.colors.get(seg.name);
        ctx.fillRect(x, y(seg.toMs), barWidth, y(seg.fromMs) - y(seg.toMs));
      }
    });
    ctx.fillStyle = "#334";
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const last = this.points.length - 1;
    ctx.fillText(this.points[last].label, left + last * slot + slot / 2, bottom + 2);
  }
}

// The axis top: four gridline steps of 1, 2 or 5 x 10^k ms, so every label is a round number.
function niceCeiling(ms) {
  const rough = ms / 4;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough);
  return 4 * step;
}
