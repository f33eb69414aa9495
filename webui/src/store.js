// Conversations and settings, kept in this browser's localStorage.
//
// A conversation: {id, title, created, updated, model, messages}. A message: {role,
// content} and, for answers, reasoning, tool_calls, state (done/stopped/error, or streaming: to be resumed) and stats
// (the server's timings for that turn: cache_n, prompt_n, predicted_n,
// predicted_per_second, and the slot it ran on).

const CONVERSATIONS = 'lss.conversations';
const CURRENT = 'lss.current';
const SETTINGS = 'lss.settings';
export const EXPORT_FORMAT = 'llama-slot-server.conversations';

function read(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch {
    return fallback;
  }
}

export function newId() {
  const a = new Uint8Array(8);
  crypto.getRandomValues(a);
  return Array.from(a, (b) => b.toString(16).padStart(2, '0')).join('');
}

export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  return Array.isArray(list) ? list.map(cleanConversation).filter(Boolean) : [];
}

// Over the browser's storage quota (images are large), the conversations are kept without
// their images: the text survives a reload, the images stay on screen until then.
export function saveConversations(list) {
  try {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
  } catch {
    const bare = list.map((c) => ({ ...c, messages: c.messages.map(({ images, ...m }) => m) }));
    localStorage.setItem(CONVERSATIONS, JSON.stringify(bare));
  }
}

export function currentId() {
  return localStorage.getItem(CURRENT);
}

export function setCurrentId(id) {
  if (id) localStorage.setItem(CURRENT, id);
  else localStorage.removeItem(CURRENT);
}

export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: 'New chat', created: now, updated: now, model: '', messages: [] };
}

export const DEFAULT_SETTINGS = { system: '', temperature: '', top_p: '', max_tokens: '', extra: '', model: '' };

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(s) {
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

const ROLES = new Set(['system', 'user', 'assistant', 'tool']);
const str = (v) => (typeof v === 'string' ? v : '');
const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : undefined);

function cleanStats(s) {
  if (!s || typeof s !== 'object') return undefined;
  const out = {};
  for (const k of ['cache_n', 'prompt_n', 'predicted_n', 'predicted_per_second', 'prompt_per_second', 'slot']) {
    const v = num(s[k]);
    if (v !== undefined) out[k] = v;
  }
  return out;
}

function cleanToolCalls(calls) {
  if (!Array.isArray(calls)) return undefined;
  return calls.map((c) => ({
    id: str(c && c.id),
    type: 'function',
    function: { name: str(c && c.function && c.function.name), arguments: str(c && c.function && c.function.arguments) },
  }));
}

// A message's images: data: URLs of the kinds the page attaches, nothing else (an imported
// file cannot point an image at another host).
const IMAGE_URL = /^data:image\/(png|jpeg|gif|bmp);base64,[A-Za-z0-9+/=]+$/;

function cleanImages(list) {
  return Array.isArray(list) ? list.filter((u) => typeof u === 'string' && IMAGE_URL.test(u)).slice(0, 16) : [];
}

function cleanMessage(m) {
  if (!m || typeof m !== 'object' || !ROLES.has(m.role)) return null;
  const out = { role: m.role, content: str(m.content) };
  if (m.reasoning) out.reasoning = str(m.reasoning);
  const calls = cleanToolCalls(m.tool_calls);
  if (calls && calls.length) out.tool_calls = calls;
  if (m.tool_call_id) out.tool_call_id = str(m.tool_call_id);
  const images = cleanImages(m.images);
  if (m.role === 'user' && images.length) out.images = images;
  if (['done', 'stopped', 'error', 'streaming'].includes(m.state)) out.state = m.state;
  const stats = cleanStats(m.stats);
  if (stats) out.stats = stats;
  return out;
}

// Only known fields of the known types survive: what a file or an old page version wrote
// cannot put anything else into the page's state.
export function cleanConversation(c) {
  if (!c || typeof c !== 'object' || !Array.isArray(c.messages)) return null;
  const now = Date.now();
  return {
    id: /^[0-9a-f]{16}$/.test(c.id) ? c.id : newId(),
    title: str(c.title).slice(0, 200) || 'Imported chat',
    created: num(c.created) || now,
    updated: num(c.updated) || now,
    model: str(c.model),
    messages: c.messages.map(cleanMessage).filter(Boolean),
  };
}

export function exportJSON(list) {
  return JSON.stringify({ format: EXPORT_FORMAT, version: 1, conversations: list }, null, 2);
}

// The conversations of an exported file (or a bare list, or one conversation), cleaned;
// throws on anything else.
export function importJSON(text, existingIds) {
  const data = JSON.parse(text);
  let list = data;
  if (data && !Array.isArray(data)) list = Array.isArray(data.conversations) ? data.conversations : [data];
  const out = list.map(cleanConversation).filter(Boolean);
  if (!out.length) throw new Error('no conversations in this file');
  for (const c of out) if (existingIds.has(c.id)) c.id = newId();
  return out;
}
