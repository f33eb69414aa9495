// The chat page: wires the composer, settings, model name or picker (router mode), API key
// field, conversation list and cache panel together.

import { auth, getJSON, setKey } from './api.js';
import { busy, extraFields, renderMessages, resumeAnswer, send, state, stop } from './chat.js';
import { $, el } from './dom.js';
import { hasPending, setupAttachments, setVision, takePending } from './images.js';
import { renderTurns, startLive } from './panel.js';
import { newChat, renderList, select, setupSidebar } from './sidebar.js';
import * as store from './store.js';

let router = false; // the server is a router (/props role "router"): several models
let refreshLive = () => {};

const SETTING_INPUTS = { system: 'set-system', temperature: 'set-temperature', top_p: 'set-top-p', max_tokens: 'set-max-tokens', extra: 'set-extra' };

function setupSettings() {
  for (const [key, id] of Object.entries(SETTING_INPUTS)) {
    const input = $(id);
    input.value = state.settings[key] ?? '';
    input.addEventListener('input', () => {
      state.settings[key] = input.value;
      store.saveSettings(state.settings);
      if (key === 'extra') checkExtra();
    });
  }
  checkExtra();
}

function checkExtra() {
  let msg = '';
  try {
    extraFields(state.settings.extra || '');
  } catch (e) {
    msg = `Not used: ${e.message}`;
  }
  $('set-extra-error').textContent = msg;
  $('set-extra').setAttribute('aria-invalid', msg ? 'true' : 'false');
}

// A header button that shows or hides ``target``: with its hidden attribute (settings), or
// with a class on the body that only narrow screens look at (the list and the cache panel
// stay in view on wide ones).
function toggle(button, target, useHidden) {
  button.addEventListener('click', () => {
    const open = button.getAttribute('aria-expanded') !== 'true';
    button.setAttribute('aria-expanded', String(open));
    if (useHidden) target.hidden = !open;
    else document.body.classList.toggle(`open-${target.id}`, open);
    if (open) (target.querySelector('input, textarea, select, button') || target).focus();
  });
}

function setupComposer() {
  const prompt = $('prompt');
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    if (busy() || (!prompt.value.trim() && !hasPending())) return;
    if (send(prompt.value, takePending())) prompt.value = '';
  });
  prompt.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    } else if (e.key === 'Escape' && busy()) {
      e.preventDefault();
      stop();
    }
  });
  $('stop').addEventListener('click', stop);
}

function showAuth() {
  const form = $('auth');
  if (!form.hidden) return;
  form.hidden = false;
  $('auth-text').textContent = auth.key ? 'The server refused this API key: enter another.' : 'This server needs an API key.';
  $('api-key').focus();
}

function setupAuth() {
  auth.onUnauthorized = showAuth;
  $('auth').addEventListener('submit', (e) => {
    e.preventDefault();
    setKey($('api-key').value);
    $('api-key').value = '';
    $('auth').hidden = true;
    loadModel();
    refreshLive();
    $('prompt').focus();
  });
}

// The live view's query (router mode): the picked model's slots and cache, without starting
// it (only a chat request may load a model; a page left open must not).
function modelQuery() {
  return router && state.model ? `?model=${encodeURIComponent(state.model)}&autoload=false` : '';
}

// A model without a chat template of its own (the server formats the chat with a built-in
// template it picked by the model's architecture): a base model, which continues text
// rather than answering, and may not end its answer.
function showTemplateNotice(props) {
  const box = $('template-notice');
  const fallback = Boolean(props && props.chat_template_fallback);
  box.hidden = !fallback;
  box.textContent = fallback
    ? `This model has no chat template of its own: it is likely a base model, not tuned to chat, and its answers may not stop by themselves (each is cut at the max tokens limit, see Settings). The server formats the chat with its built-in "${props.chat_template_name}" template.`
    : '';
}

// Router mode: the notice is about the picked model, read from its /props once it runs
// (never started for it: autoload=false).
let noticeFor = '';

async function routerNotice(models) {
  const picked = models.find((m) => m.id === state.model);
  if (!picked || noticeFor === state.model || !picked.status || picked.status.value !== 'loaded') return;
  const name = state.model;
  const props = await getJSON(`/props?model=${encodeURIComponent(name)}&autoload=false`);
  if (state.model !== name) return;
  noticeFor = name;
  showTemplateNotice(props);
}

async function refreshModels() {
  if (!router) return;
  const picker = $('model-picker');
  const { data } = await getJSON('/models');
  const models = Array.isArray(data) ? data : [];
  if (!state.model && models.length) state.model = (models.find((m) => m.status && m.status.value === 'loaded') || models[0]).id;
  const options = models.map((m) => {
    const status = (m.status && m.status.value) || 'unknown';
    return el('option', { value: m.id, 'data-status': status, text: `${m.id} (${status})`, selected: m.id === state.model });
  });
  if (picker.matches(':focus') && picker.options.length === options.length) {
    // keep the open list in place: relabel only
    options.forEach((o, i) => { picker.options[i].textContent = o.textContent; picker.options[i].dataset.status = o.dataset.status; });
  } else picker.replaceChildren(...options);
  picker.value = state.model;
  const picked = models.find((m) => m.id === state.model);
  const inputs = (picked && picked.architecture && picked.architecture.input_modalities) || [];
  setVision(inputs.includes('image'));
  await routerNotice(models);
}

async function loadModel() {
  try {
    const props = await getJSON('/props');
    router = props.role === 'router';
    $('model-picker').hidden = !router;
    $('model-picker-label').hidden = !router;
    $('model-name').hidden = router;
    if (router) {
      state.model = state.settings.model || '';
      await refreshModels();
    } else {
      $('model-name').textContent = props.model_alias || (props.model_path || '').split('/').pop() || '';
      showTemplateNotice(props);
      setVision(props.modalities && props.modalities.vision);
    }
  } catch (e) {
    $('model-name').textContent = e.status === 401 ? '' : `(${e.message})`;
  }
}

function setupModelPicker() {
  $('model-picker').addEventListener('change', (e) => {
    state.model = e.target.value;
    noticeFor = '';
    showTemplateNotice(null);
    state.settings.model = state.model;
    store.saveSettings(state.settings);
    if (state.conv) state.conv.model = state.model;
    refreshLive();
    refreshModels().catch(() => {}); // the picked model's input modalities (images)
  });
}

function boot() {
  state.conversations = store.loadConversations();
  const id = store.currentId();
  state.listeners.changed = () => { renderList(); renderTurns(state.conv); };
  state.listeners.turnDone = () => refreshLive();
  setupAuth();
  setupSettings();
  setupComposer();
  setupAttachments();
  setupModelPicker();
  setupSidebar((conv) => {
    renderTurns(conv);
    if (router && conv.model && conv.model !== state.model) {
      state.model = conv.model;
      $('model-picker').value = conv.model;
      noticeFor = '';
      showTemplateNotice(null);
    }
  });
  toggle($('toggle-settings'), $('settings'), true);
  toggle($('toggle-sidebar'), $('sidebar'), false);
  toggle($('toggle-panel'), $('cache-panel'), false);
  const current = state.conversations.find((c) => c.id === id) || state.conversations[0];
  if (current) select(current);
  else newChat();
  loadModel().then(() => { refreshLive = startLive(modelQuery, refreshModels); });
  resumeAnswer();
  $('prompt').focus();
}

boot();
