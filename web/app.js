// The voice-chat demo page: Start opens the speakers, the microphone and a `/ws` session; the server's
// events become chat bubbles, reply audio goes to the player, each finished reply's timings go to the
// latency chart, tool calls to `tools.js`; camera frames come from `camera.js`. `window.demo` exposes the
// page's state (counters, transcripts, turns, tool calls, images sent) for tests and the devtools console.
//
// Query parameters (optional): `instructions`, `max_tokens` (the reply's sampling limit),
// `input_rate` (16000 or 24000, preselects the rate menu) and `tools=1` (checks the Tools box).

import { Microphone, microphoneContext, OUTPUT_RATE, Player, playerContext } from "./audio.js";
import { DemoCamera } from "./camera.js";
import { LatencyChart } from "./chart.js";
import { Chat } from "./chat.js";
import { NativeSession } from "./protocol.js";
import { DemoTools } from "./tools.js";

// NOTE: the server cuts an interrupted reply to the last report it has when the user's speech starts,
// so the report interval bounds how much unheard audio the conversation can keep.
const PLAYBACK_REPORT_MS = 250;

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), statusText: $("status-text"), start: $("start"), rate: $("input-rate"), tools: $("tools"),
  form: $("text-form"), text: $("text-input"), cancel: $("cancel"), meter: $("mic-level"), stats: $("stats"),
};
const query = new URLSearchParams(location.search);
if (["16000", "24000"].includes(query.get("input_rate"))) ui.rate.value = query.get("input_rate");

const chat = new Chat($("chat"));
const chart = new LatencyChart($("latency-chart"), $("latency-legend"), $("latency-summary"));
const tools = new DemoTools(chat, ui.tools, query);
const demo = {
  state: "idle", closeCode: null, closeReason: "", microphone: "", inputRate: null, toolCalls: tools.calls,
  numFramesSent: 0, numAudioSamplesReceived: 0, numAudioSamplesPlayed: 0, numAudioSamplesDropped: 0,
  bufferedSamples: 0, numBargeIns: 0, numPauses: 0, numResumes: 0, numPlaybackReports: 0, lastPlayedMs: null,
  transcripts: chat.entries, turns: [], interruptions: [], truncations: [], chartPoints: chart.points, errors: [], events: [],
};
window.demo = demo;

let session = null;
let mic = null;
let player = null;
let reportTimer = null;
// The latest response: {id, itemId, start (its first sample's position in the reply stream),
// isAccepting (its audio is still wanted), isDone, isFlushed, lastReportedMs, startedAt, firstAudioAt}.
let response = null;
// Replies cut short, by item id: {why, playedMs (what this page played), keptMs (what the server kept)}.
const cuts = new Map();
const camera = new DemoCamera(chat, $("camera"), ui.text, () => session);
demo.images = camera.images;

function setState(state, detail = "") {
  demo.state = state;
  ui.status.className = `status ${state}`;
  ui.statusText.textContent = detail ? `${state}: ${detail}` : state;
  ui.start.textContent = state === "idle" || state === "closed" ? "Start" : "Stop";
  const isLive = state === "connected";
  ui.text.disabled = !isLive;
  ui.form.querySelector("button").disabled = !isLive;
  ui.rate.disabled = ui.tools.disabled = !(state === "idle" || state === "closed");
}

function showStats() {
  const s = (samples) => (samples / OUTPUT_RATE).toFixed(1);
  ui.stats.textContent = `mic frames sent ${demo.numFramesSent} · reply audio received ${s(demo.numAudioSamplesReceived)} s,`
    + ` played ${s(demo.numAudioSamplesPlayed)} s, buffered ${s(demo.bufferedSamples)} s · barge-ins ${demo.numBargeIns}`;
}

async function start() {
  ui.start.disabled = true;
  setState("connecting");
  const inputRate = Number(ui.rate.value);
  demo.inputRate = inputRate;
  // NOTE: both contexts before the first await, while the click still counts as a user gesture.
  const outContext = playerContext();
  const micContext = microphoneContext();
  try {
    player = await Player.open(outContext, onPlayerState);
  } catch (error) {
    micContext.close();
    setState("closed", `cannot open audio output (${error.message})`);
    ui.start.disabled = false;
    return;
  }
  try {
    mic = await Microphone.open(micContext, inputRate, onMicFrame);
    demo.microphone = mic.label;
  } catch (error) {
    // NOTE: a denied or missing microphone still leaves a useful demo: typed turns, spoken replies.
    chat.notice(`microphone unavailable (${error.name}: ${error.message}); type instead`);
  }
  // NOTE: no turn_detection: the server's default (semantic_vad on the CPU defaults, which pauses a reply on
  // speech over it and resumes it when that was only an "uh huh").
  const startMessage = { input_rate: inputRate, output_rate: OUTPUT_RATE, ...tools.startFields() };
  if (query.get("instructions")) startMessage.instructions = query.get("instructions");
  const maxTokens = Number.parseInt(query.get("max_tokens") ?? "", 10);
  if (maxTokens > 0) startMessage.params = { sampling: { max_tokens: maxTokens } };
  session = new NativeSession(NativeSession.urlFor(location), startMessage, { onOpen, onEvent, onAudio, onClose });
  reportTimer = setInterval(reportPlayback, PLAYBACK_REPORT_MS);
  ui.start.disabled = false;
}

async function teardown() {
  clearInterval(reportTimer);
  reportTimer = null;
  session = null;
  response = null;
  const closing = [mic?.close(), player?.close()];
  mic = null;
  player = null;
  ui.meter.value = 0;
  camera.stop();
  await Promise.allSettled(closing);
}

// -- the session's events ------------------------------------------------------------------------------

function onOpen(started) {
  setState("connected", `input ${started.input_rate} Hz, output ${started.output_rate} Hz${mic ? "" : ", no microphone"}`);
  camera.onStarted(started);
}

function onClose(code, reason) {
  demo.closeCode = code;
  demo.closeReason = reason;
  setState("closed", `${code}${reason ? ` ${reason}` : ""}`);
  teardown();
}

function onMicFrame(pcm, level) {
  ui.meter.value = Math.min(1, level * 5);
  if (session?.sendAudio(pcm)) demo.numFramesSent += 1;
  if (demo.numFramesSent % 25 === 0) showStats();
}

function onAudio(data) {
  const numSamples = data.byteLength / 2;
  if (!player || !response || !response.isAccepting) {
    demo.numAudioSamplesDropped += numSamples; // NOTE: a chunk already in flight when a barge-in flushed
    return;
  }
  response.firstAudioAt ??= performance.now();
  player.push(data);
  demo.numAudioSamplesReceived += numSamples;
}

function onPlayerState(p) {
  demo.numAudioSamplesPlayed = p.played;
  demo.bufferedSamples = p.buffered;
  showStats();
}

const handlers = {
  speech_started(e) {
    chat.update(e.item_id, "user", { state: "listening…" });
    if (response && !response.isFlushed && (!response.isDone || player?.isPlaying)) interrupt(response, "interrupted");
  },
  response_paused(e) {
    // NOTE: speech over the reply, not yet a turn: hold what is queued (the server holds the rest).
    if (response?.id === e.response_id && !response.isFlushed) {
      player?.pause();
      demo.numPauses += 1;
      chat.update(response.itemId, "assistant", { state: "paused…" });
    }
  },
  response_resumed(e) {
    if (response?.id === e.response_id && !response.isFlushed) {
      player?.resume();
      demo.numResumes += 1;
      chat.update(response.itemId, "assistant", { state: "speaking…" });
    }
  },
  speech_stopped(e) {
    chat.update(e.item_id, "user", { state: "thinking…" });
  },
  input_committed(e) {
    const state = e.audio_ms ? `spoken, ${(e.audio_ms / 1000).toFixed(1)} s` : "typed";
    const entry = chat.update(e.item_id, "user", { state, text: e.text ? e.text : undefined });
    entry.committed = true;
  },
  input_transcript_delta(e) {
    chat.update(e.item_id, "user", { append: e.delta });
  },
  input_transcript_done(e) {
    chat.update(e.item_id, "user", { text: e.transcript });
  },
  response_started(e) {
    response = {
      id: e.response_id, itemId: e.item_id, start: player ? player.written : 0, isAccepting: true, isDone: false,
      isFlushed: false, lastReportedMs: null, startedAt: performance.now(), firstAudioAt: null,
    };
    chat.update(e.item_id, "assistant", { state: "speaking…" });
  },
  text_delta(e) {
    if (response?.id === e.response_id) chat.update(response.itemId, "assistant", { append: e.delta });
  },
  item_truncated(e) {
    demo.truncations.push({ itemId: e.item_id, audioEndMs: e.audio_end_ms });
    noteCut(e.item_id, { keptMs: e.audio_end_ms });
  },
  response_done(e) {
    const r = response?.id === e.response_id ? response : null;
    if (r) r.isDone = true;
    // NOTE: what the listener waited for is the first audible frame; the first byte is the fallback.
    const firstAudioMs = e.timings_ms?.first_audible ?? e.timings_ms?.first_audio_sent ?? null;
    const turn = {
      responseId: e.response_id, itemId: e.item_id, status: e.status, text: e.text, audioMs: e.audio_ms,
      timingsMs: e.timings_ms ?? {}, firstAudioMs,
      clientFirstAudioMs: r?.firstAudioAt != null ? Math.round(r.firstAudioAt - r.startedAt) : null,
    };
    demo.turns.push(turn);
    chart.add(`#${demo.turns.length}`, e.timings_ms);
    // NOTE: the server's text of a cut reply is the words spoken up to where it was cut.
    chat.update(e.item_id, "assistant", { text: e.text });
    if (cuts.has(e.item_id)) {
      noteCut(e.item_id, {});
    } else if (e.status === "completed") {
      const latency = firstAudioMs != null ? `, first audio after ${firstAudioMs.toFixed(0)} ms` : "";
      chat.update(e.item_id, "assistant", { state: `${e.audio_ms} ms of audio${latency}` });
    } else {
      chat.update(e.item_id, "assistant", { state: e.status === "failed" ? `failed: ${e.error}` : e.status });
    }
    if (e.status !== "completed") chat.mark(e.item_id, e.status);
  },
  error(e) {
    chat.notice(`error ${e.code}: ${e.message}`);
  },
};

function onEvent(event) {
  demo.events.push(event.type);
  if (demo.events.length > 200) demo.events.shift();
  if (event.type === "error") demo.errors.push(event);
  if (!tools.onEvent(event, session) && !camera.onEvent(event)) handlers[event.type]?.(event);
}

// -- playback reports and barge-in ---------------------------------------------------------------------

function playedMsOf(r, position) {
  return Math.floor((Math.max(0, position - r.start) * 1000) / OUTPUT_RATE);
}

// While a reply plays, tell the server how much of it was heard (only when that changed).
function reportPlayback() {
  if (!session || !player || !response || response.isFlushed) return;
  const playedMs = playedMsOf(response, player.position);
  if (playedMs === response.lastReportedMs || (playedMs === 0 && response.lastReportedMs === null)) return;
  sendReport(response, playedMs);
}

function sendReport(r, playedMs) {
  if (session?.reportPlayback(playedMs)) {
    r.lastReportedMs = playedMs;
    demo.numPlaybackReports += 1;
    demo.lastPlayedMs = playedMs;
  }
}

// Stop the reply's audio at once (the user spoke over it, or pressed Stop reply) and report exactly
// how much of it was played.
async function interrupt(r, why) {
  if (!player) return;
  r.isAccepting = false;
  r.isFlushed = true;
  if (why === "interrupted") demo.numBargeIns += 1;
  noteCut(r.itemId, { why });
  const heard = await player.flush();
  const playedMs = playedMsOf(r, heard);
  sendReport(r, playedMs);
  demo.interruptions.push({
    responseId: r.id, why, playedMs, receivedMs: playedMsOf(r, player.written), totalPlayedSamples: player.played,
  });
  noteCut(r.itemId, { playedMs });
  showStats();
}

// A cut reply's note: what this page played, and what the server kept in the conversation (the last
// playback report it had when the speech started, or everything sent without one).
function noteCut(itemId, part) {
  const cut = { ...cuts.get(itemId), ...part };
  cuts.set(itemId, cut);
  const notes = [cut.why ?? "interrupted"];
  if (cut.playedMs != null) notes.push(`${cut.playedMs} ms played`);
  if (cut.keptMs != null) notes.push(`${cut.keptMs} ms kept`);
  chat.update(itemId, "assistant", { state: notes.join(", ") });
  chat.mark(itemId, "interrupted");
}

// -- controls ------------------------------------------------------------------------------------------

ui.start.addEventListener("click", () => (session ? session.close("client stopped") : start()));
ui.cancel.addEventListener("click", () => {
  if (!session || !response || response.isFlushed) return;
  if (!response.isDone) session.cancelResponse();
  interrupt(response, "stopped");
});
ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.text.value.trim();
  if (text && session?.sendText(text)) ui.text.value = "";
});
setState("idle");
showStats();
