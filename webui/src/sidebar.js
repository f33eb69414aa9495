// The conversation list: select, new, rename, delete; export and import as JSON.

import { $, el } from './dom.js';
import { busy, renderMessages, state } from './chat.js';
import * as store from './store.js';

let onSelect = () => {};

export function select(conv) {
  if (busy()) return;
  state.conv = conv;
  store.setCurrentId(conv.id);
  renderMessages();
  renderList();
  onSelect(conv);
}

export function newChat() {
  if (busy()) return;
  const empty = state.conversations.find((c) => !c.messages.length);
  const conv = empty || store.newConversation();
  if (!empty) state.conversations.unshift(conv);
  store.saveConversations(state.conversations);
  select(conv);
  $('prompt').focus();
}

function remove(conv) {
  if (busy() || !window.confirm(`Delete “${conv.title}”?`)) return;
  state.conversations = state.conversations.filter((c) => c !== conv);
  store.saveConversations(state.conversations);
  if (state.conv === conv) {
    if (state.conversations.length) select(state.conversations[0]);
    else newChat();
  } else renderList();
}

function rename(li, conv) {
  const input = el('input', { type: 'text', class: 'rename', 'aria-label': 'Conversation name', 'data-testid': 'rename-input' });
  input.value = conv.title;
  const finish = (keep) => {
    if (keep && input.value.trim()) {
      conv.title = input.value.trim().slice(0, 200);
      store.saveConversations(state.conversations);
    }
    renderList();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter') { e.preventDefault(); finish(true); }
    if (e.key === 'Escape') { e.preventDefault(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

export function renderList() {
  const items = [...state.conversations].sort((a, b) => b.updated - a.updated).map((c) => {
    const li = el('li', { class: c === state.conv ? 'current' : '', 'data-testid': 'conversation', 'data-id': c.id });
    const open = el('button', { type: 'button', class: 'title', text: c.title, 'aria-current': c === state.conv ? 'true' : null });
    open.addEventListener('click', () => select(c));
    const ren = el('button', { type: 'button', class: 'icon', text: '✎', title: 'Rename', 'aria-label': `Rename ${c.title}` });
    ren.addEventListener('click', () => rename(li, c));
    const del = el('button', { type: 'button', class: 'icon', text: '✕', title: 'Delete', 'aria-label': `Delete ${c.title}` });
    del.addEventListener('click', () => remove(c));
    li.append(open, ren, del);
    return li;
  });
  $('conversation-list').replaceChildren(...items);
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: 'application/json' }));
  const a = el('a', { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

async function importFile(file) {
  try {
    const got = store.importJSON(await file.text(), new Set(state.conversations.map((c) => c.id)));
    state.conversations.unshift(...got);
    store.saveConversations(state.conversations);
    select(got[0]);
    $('status').textContent = `Imported ${got.length} conversation${got.length > 1 ? 's' : ''}.`;
  } catch (e) {
    $('status').textContent = `Import failed: ${e.message}`;
  }
}

export function setupSidebar(selected) {
  onSelect = selected;
  $('new-chat').addEventListener('click', newChat);
  $('export').addEventListener('click', () => download('conversations.json', store.exportJSON(state.conversations)));
  $('import').addEventListener('click', () => $('import-file').click());
  $('import-file').addEventListener('change', (e) => {
    const f = e.target.files[0];
    e.target.value = '';
    if (f) importFile(f);
  });
}
