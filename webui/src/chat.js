// The conversation on screen: sending, streaming an answer in, stop, regenerate and
// edit-and-resend. Both of the last two send the earlier messages unchanged, so the server
// finds their tokens in a slot (or its RAM/disk cache) and computes only what changed.

import { api, events, ApiError } from './api.js';
import { $ } from './dom.js';
import { fillAssistant, messageView } from './messages.js';
import * as store from './store.js';

export const state = {
  conversations: [],
  conv: null, // the one on screen
  settings: store.loadSettings(),
  model: '', // the model a request names (router mode: the picker's choice)
  controller: null, // the running answer's AbortController
  listeners: { changed: () => {}, turnDone: () => {} },
};

export const busy = () => state.controller !== null;

export function save() {
  state.conv.updated = Date.now();
  store.saveConversations(state.conversations);
  state.listeners.changed();
}

const handlers = {
  busy,
  regenerate: () => regenerate(),
  resend: (index, text) => resend(index, text),
};

export function renderMessages() {
  const box = $('messages');
  const msgs = state.conv ? state.conv.messages : [];
  const lastAnswer = msgs.length && msgs[msgs.length - 1].role === 'assistant' && !busy();
  box.replaceChildren(...msgs.map((m, i) => messageView(m, i, handlers, lastAnswer && i === msgs.length - 1)));
  box.scrollTop = box.scrollHeight;
}

function setBusy(on) {
  $('send').disabled = on;
  $('stop').hidden = !on;
  $('messages').setAttribute('aria-busy', on ? 'true' : 'false');
  if (!on && document.activeElement === $('stop')) $('prompt').focus();
}

function numberSetting(v, int) {
  if (v === '' || v === null || v === undefined) return undefined;
  const n = int ? parseInt(v, 10) : parseFloat(v);
  return Number.isFinite(n) ? n : undefined;
}

export function extraFields(text) {
  if (!text.trim()) return {};
  const v = JSON.parse(text);
  if (!v || typeof v !== 'object' || Array.isArray(v)) throw new Error('not a JSON object');
  return v;
}

// A user message with images: its images as image_url parts (data: URLs), then its text.
function userContent(m) {
  if (m.role !== 'user' || !m.images || !m.images.length) return m.content;
  const parts = m.images.map((u) => ({ type: 'image_url', image_url: { url: u } }));
  if (m.content) parts.push({ type: 'text', text: m.content });
  return parts;
}

function historyMessages(history) {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: 'system', content: state.settings.system });
  for (const m of history) {
    if (m.role === 'assistant' && m.state === 'error' && !m.content) continue;
    const msg = { role: m.role, content: userContent(m) };
    if (m.tool_calls && m.tool_calls.length) {
      msg.tool_calls = m.tool_calls;
      if (!m.content) msg.content = null;
    }
    if (m.tool_call_id) msg.tool_call_id = m.tool_call_id;
    out.push(msg);
  }
  return out;
}

// Most tokens an answer may have when the setting is empty: a base model (no chat template
// of its own) may never end its answer, and the server's own default (-n -1) lets it run
// until the context is full, minutes on a CPU. 0 in the setting: no limit (the server's).
export const DEFAULT_MAX_TOKENS = 1024;

function maxTokens(setting) {
  const n = numberSetting(setting, true);
  if (n === undefined) return DEFAULT_MAX_TOKENS;
  return n > 0 ? n : undefined;
}

// The chat request for ``history``: the panel's fields, then the extra fields, then the
// settings' sampling fields. Every streamed chunk carries the run's timings so far and the
// prompt's progress, so that an answer stopped before its final chunk still has its figures.
export function requestBody(history) {
  const s = state.settings;
  let extra = {};
  try {
    extra = extraFields(s.extra || '');
  } catch {
    extra = {};
  }
  const body = {
    timings_per_token: true,
    return_progress: true,
    ...extra,
    messages: historyMessages(history),
    stream: true,
    stream_options: { include_usage: true },
  };
  const fields = { temperature: numberSetting(s.temperature), top_p: numberSetting(s.top_p), max_tokens: maxTokens(s.max_tokens) };
  for (const [k, v] of Object.entries(fields)) if (v !== undefined) body[k] = v;
  if (state.model) body.model = state.model;
  return body;
}

const STAT_FIELDS = ['cache_n', 'prompt_n', 'predicted_n', 'predicted_per_second', 'prompt_per_second'];

// One streamed chunk into the answer: text, reasoning, tool-call pieces, the finish reason,
// the prompt's progress (its cached and computed tokens: it comes before any text), each chunk's
// timings and the final chunk's id_slot (the slot that ran it).
function applyChunk(msg, ev) {
  if (ev.error) throw new ApiError(ev.error.code || 500, ev.error.message || 'error');
  const p = ev.prompt_progress;
  if (p && typeof p.total === 'number' && typeof p.cache === 'number') {
    msg.stats = { ...(msg.stats || {}), cache_n: p.cache, prompt_n: p.total - p.cache };
  }
  for (const choice of ev.choices || []) {
    if (choice.finish_reason) msg.finish = choice.finish_reason;
    const d = choice.delta || {};
    if (d.content) msg.content += d.content;
    if (d.reasoning_content) msg.reasoning = (msg.reasoning || '') + d.reasoning_content;
    for (const t of d.tool_calls || []) {
      msg.tool_calls = msg.tool_calls || [];
      const c = (msg.tool_calls[t.index || 0] ||= { id: '', type: 'function', function: { name: '', arguments: '' } });
      if (t.id) c.id = t.id;
      if (t.function && t.function.name) c.function.name += t.function.name;
      if (t.function && t.function.arguments) c.function.arguments += t.function.arguments;
    }
  }
  if (ev.timings) {
    const stats = { ...(msg.stats || {}) };
    for (const k of STAT_FIELDS) if (typeof ev.timings[k] === 'number') stats[k] = ev.timings[k];
    msg.stats = stats;
  }
  if (typeof ev.id_slot === 'number') msg.stats = { ...(msg.stats || {}), slot: ev.id_slot };
}

// Answers are resumable streams named by their conversation's id (X-Conversation-Id): the
// server goes on generating when the page goes, and a reloaded page replays the answer from
// its first byte (GET /v1/stream) and follows it live. An id the server would refuse (an
// imported conversation's) is sent without a name.
const NAMEABLE = /^[A-Za-z0-9._~:/@+=-]{1,256}$/;
const streamPath = (conv) => '/v1/stream?conv_id=' + encodeURIComponent(conv.id);
let running = null; // the conversation whose answer streams in
let leaving = false; // the page goes (a reload): a cut answer stays 'streaming', to be resumed
addEventListener('pagehide', () => { leaving = true; });

function startAnswer(conv, resume) {
  if (resume) {
    const msg = conv.messages[conv.messages.length - 1];
    for (const k of ['reasoning', 'tool_calls', 'stats', 'finish']) delete msg[k];
    msg.content = '';
    return { msg, open: (signal) => api(streamPath(conv) + '&from=0', { signal }) };
  }
  const history = conv.messages.slice();
  const msg = { role: 'assistant', content: '', state: 'streaming' };
  conv.messages.push(msg);
  save(); // a reloaded page finds the answer it has to resume
  const headers = NAMEABLE.test(conv.id) ? { 'X-Conversation-Id': conv.id } : {};
  const body = JSON.stringify(requestBody(history));
  return { msg, open: (signal) => api('/v1/chat/completions', { method: 'POST', body, signal, headers }) };
}

// Streams an answer to the conversation's messages in (``resume``: the last one, again
// from the server's replay buffer); the answer is appended to them.
async function runTurn(resume = false) {
  const conv = state.conv;
  const { msg, open } = startAnswer(conv, resume);
  state.controller = new AbortController();
  running = conv;
  renderMessages();
  const art = $('messages').lastElementChild;
  fillAssistant(art, msg, true);
  setBusy(true);
  let timer = null;
  const paint = () => { timer = null; fillAssistant(art, msg, true); $('messages').scrollTop = $('messages').scrollHeight; };
  try {
    const r = await open(state.controller.signal);
    for await (const ev of events(r)) {
      applyChunk(msg, ev);
      if (timer === null) timer = setTimeout(paint, 60);
    }
    msg.state = 'done';
  } catch (e) {
    if (leaving) msg.state = 'streaming';
    else if (e.name === 'AbortError') msg.state = 'stopped';
    else Object.assign(msg, { state: 'error', error: e.message });
  } finally {
    clearTimeout(timer);
    state.controller = null;
    running = null;
    setBusy(false);
    if (state.conv === conv) renderMessages();
    save();
    state.listeners.turnDone(conv);
  }
}

// On load: the conversation on screen ended with an answer still streaming when the page
// went. Its stream is looked up by id; found, it is replayed, else the answer is stopped.
export async function resumeAnswer() {
  const conv = state.conv;
  const last = conv && conv.messages[conv.messages.length - 1];
  if (!last || last.role !== 'assistant' || last.state !== 'streaming' || busy()) return;
  let found = [];
  try {
    const body = JSON.stringify({ conversation_ids: [conv.id] });
    found = await (await api('/v1/streams/lookup', { method: 'POST', body })).json();
  } catch {
    found = [];
  }
  if (state.conv !== conv || busy()) return;
  if (Array.isArray(found) && found.some((s) => s.conversation_id === conv.id)) runTurn(true);
  else {
    last.state = 'stopped';
    save();
    renderMessages();
  }
}

// ``images``: data: URLs sent with the text (images.js); a message may be images alone.
export function send(text, images = []) {
  if (busy() || (!text.trim() && !images.length) || !state.conv) return false;
  const conv = state.conv;
  if (!conv.messages.some((m) => m.role === 'user')) conv.title = (text.trim().replace(/\s+/g, ' ') || 'Image').slice(0, 48);
  const msg = { role: 'user', content: text };
  if (images.length) msg.images = images;
  conv.messages.push(msg);
  save(); // the question is kept even if the page goes before the answer ends
  runTurn();
  return true;
}

// Stop: the reading ends, and the server's generation with it (a named stream outlives
// its reader otherwise).
export function stop() {
  if (!state.controller) return;
  state.controller.abort();
  if (running && NAMEABLE.test(running.id)) api(streamPath(running), { method: 'DELETE' }).catch(() => {});
}

export function regenerate() {
  const msgs = state.conv.messages;
  if (busy() || !msgs.length || msgs[msgs.length - 1].role !== 'assistant') return;
  msgs.pop();
  runTurn();
}

export function resend(index, text) {
  if (busy() || !text.trim()) return;
  const conv = state.conv;
  const images = conv.messages[index] && conv.messages[index].images; // kept with the edit
  conv.messages = conv.messages.slice(0, index);
  conv.messages.push(images ? { role: 'user', content: text, images } : { role: 'user', content: text });
  runTurn();
}
