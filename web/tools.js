// Function calling in the demo: a few tools that run here in the page (the browser is the client that
// answers the server's `tool_call`), each honest about what it returns: the local time from this
// browser's clock, a fair die roll. With the Tools box checked they go in `session.start`; each call
// shows in the chat as a tool entry (never as the assistant's words), its output follows, and the page
// answers with `tool_result`. Calls the server refused (`error` events `tool_call_*`) show as failed calls.
// `calls` mirrors the entries for tests: {callId, responseId, name, arguments, output, status, error}.

const TOOLS = {
  get_time: {
    description: "The user's current local date, time and time zone, from their own device's clock.",
    parameters: { type: "object", properties: {}, additionalProperties: false },
    run() {
      const now = new Date();
      return {
        local_time: now.toLocaleString(undefined, { dateStyle: "full", timeStyle: "short" }),
        time_zone: Intl.DateTimeFormat().resolvedOptions().timeZone,
        iso: now.toISOString(),
      };
    },
  },
  roll_dice: {
    description: "Roll one fair die; gives the face that came up.",
    parameters: {
      type: "object", additionalProperties: false,
      properties: { sides: { type: "integer", minimum: 2, maximum: 1000, description: "its number of sides; 6 if not given" } },
    },
    run({ sides = 6 }) {
      // NOTE: the modulo bias of a 32-bit value over at most 1000 sides is below 1 in 4 million.
      return { sides, roll: 1 + (crypto.getRandomValues(new Uint32Array(1))[0] % sides) };
    },
  },
};

// The session.start `tools`: OpenAI function tools.
export const TOOL_SPECS = Object.entries(TOOLS).map(([name, { description, parameters }]) => (
  { type: "function", name, description, parameters }));

// A call -> its output as JSON text; never throws: whatever fails is an `{"error": ...}` output, so the
// model hears why rather than the conversation waiting on an answer that never comes.
async function run(name, argumentsText) {
  const tool = Object.hasOwn(TOOLS, name) ? TOOLS[name] : null;
  try {
    if (!tool) throw new Error(`unknown tool ${JSON.stringify(name)}; this page has ${Object.keys(TOOLS).join(", ")}`);
    return JSON.stringify(await tool.run(JSON.parse(argumentsText || "{}")));
  } catch (error) {
    return JSON.stringify({ error: error.message });
  }
}

export class DemoTools {
  // `chat`: the conversation (`chat.js`); `toggle`: the Tools checkbox; `query`: the page's (`tools=1` checks it).
  constructor(chat, toggle, query) {
    this.chat = chat;
    this.toggle = toggle;
    this.calls = [];
    this.pending = new Map(); // response id -> [{call, itemId, output (a promise)}]
    this.answered = new Map(); // call id -> {call, itemId, isCut}: the server commits each output with its call id
    if (query.get("tools") === "1") toggle.checked = true;
  }

  // What `session.start` gets: the tools when the box is checked, else nothing (the server's default: none).
  startFields() {
    return this.toggle.checked ? { tools: TOOL_SPECS } : {};
  }

  // Handle what is about tools; true when the event was only that (the page shows nothing else for it).
  onEvent(event, session) {
    if (event.type === "tool_call") {
      this.call(event);
      return true;
    }
    if (event.type === "error" && event.code?.startsWith("tool_call")) {
      this.refused(event);
      return true;
    }
    if (event.type === "response_done") this.answer(event, session);
    if (event.type === "input_committed" && this.answered.has(event.call_id)) {
      const { call, itemId, isCut } = this.answered.get(event.call_id);
      this.answered.delete(event.call_id);
      this.show(itemId, call, isCut ? "answered, no new reply (the reply was cut short)" : "answered");
      return true; // NOTE: the output going into the conversation, not something the user typed
    }
    return false;
  }

  call(e) {
    const call = { callId: e.call_id, responseId: e.response_id, name: e.name, arguments: e.arguments,
      output: null, status: "running", error: null };
    this.calls.push(call);
    this.show(e.item_id, call, "running…");
    const output = run(e.name, e.arguments).then((text) => {
      call.output = text;
      this.show(e.item_id, call, "done; answered when the reply ends");
      return text;
    });
    const calls = this.pending.get(e.response_id) ?? [];
    calls.push({ call, itemId: e.item_id, output });
    this.pending.set(e.response_id, calls);
  }

  // Answer a response's calls once it is done: a result with `respond` while it still runs would cancel
  // it (the words before the call would be cut). Only the last answer asks for the next response, and
  // none does when the response was cut short (a barge-in's own turn has the floor): the outputs still go
  // into the conversation, so every call there has its answer.
  async answer(e, session) {
    const calls = this.pending.get(e.response_id);
    if (!calls) return;
    this.pending.delete(e.response_id);
    this.chat.mark(e.item_id, "with-calls"); // NOTE: a reply that only called says nothing: no empty bubble
    const outputs = await Promise.all(calls.map((c) => c.output));
    const isCut = e.status !== "completed";
    calls.forEach(({ call, itemId }, i) => {
      const isSent = session?.sendToolResult(call.callId, outputs[i], !isCut && i === calls.length - 1) ?? false;
      if (isSent) this.answered.set(call.callId, { call, itemId, isCut });
      this.show(itemId, call, isSent ? "sent" : "not sent: the session closed");
    });
  }

  refused(e) {
    const call = { callId: null, responseId: null, name: null, arguments: null, output: null, status: "failed",
      error: e.code };
    this.calls.push(call);
    const id = `tool-error-${this.calls.length}`;
    this.chat.update(id, "tool", { text: `🔧 call refused (${e.code})`, state: e.message });
    this.chat.mark(id, "failed");
  }

  show(itemId, call, status) {
    call.status = status;
    const output = call.output === null ? "" : `\n→ ${call.output}`;
    this.chat.update(itemId, "tool", { text: `🔧 ${call.name}(${call.arguments})${output}`, state: status });
    if (call.output?.startsWith('{"error"')) this.chat.mark(itemId, "failed");
  }
}
