// Images attached to the next message (when the server's model reads images: /props
// modalities.vision, or in router mode the picked model's input_modalities): by the button's
// file picker, by pasting into the message box and by dropping onto the composer. Each is
// kept as a data: URL (shown as a thumbnail, sent as an image_url part, saved with the
// conversation). Only the kinds the server decodes are taken; the server bounds the rest.

import { $, el } from './dom.js';

export const KINDS = ['image/png', 'image/jpeg', 'image/gif', 'image/bmp'];
export const MAX_IMAGES = 16;
export const MAX_BYTES = 10 << 20; // the server's --image-max-mib default

const pending = []; // data: URLs of the next message
let enabled = false;

export function setVision(on) {
  enabled = Boolean(on);
  $('attach').hidden = !enabled;
  if (!enabled) clear();
}

export const visionOn = () => enabled;

export function takePending() {
  const out = pending.splice(0);
  render();
  return out;
}

export function hasPending() {
  return pending.length > 0;
}

function clear() {
  pending.splice(0);
  render();
}

function note(text) {
  $('attach-note').textContent = text;
}

function render() {
  const box = $('attachments');
  box.hidden = pending.length === 0;
  box.replaceChildren(...pending.map((url, i) => {
    const remove = el('button', { type: 'button', class: 'small', text: '×', 'aria-label': `Remove image ${i + 1}`, 'data-testid': 'attachment-remove' });
    remove.addEventListener('click', () => { pending.splice(i, 1); render(); });
    return el('div', { class: 'attachment', 'data-testid': 'attachment' },
      el('img', { class: 'thumb', src: url, alt: `Image ${i + 1} to send` }), remove);
  }));
}

function read(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(String(r.result));
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

// Takes the image files among ``files``; says why any other was left out.
export async function addFiles(files) {
  if (!enabled) return;
  const skipped = [];
  for (const f of files) {
    if (!KINDS.includes(f.type)) skipped.push(`${f.name || 'a file'}: not PNG, JPEG, GIF or BMP`);
    else if (f.size > MAX_BYTES) skipped.push(`${f.name || 'an image'}: over ${MAX_BYTES >> 20} MiB`);
    else if (pending.length >= MAX_IMAGES) skipped.push(`at most ${MAX_IMAGES} images`);
    else pending.push(await read(f));
  }
  note(skipped.join('; '));
  render();
}

export function setupAttachments() {
  const input = $('attach-file');
  $('attach').addEventListener('click', () => input.click());
  input.addEventListener('change', async () => {
    await addFiles([...input.files]);
    input.value = '';
  });
  $('prompt').addEventListener('paste', (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (!enabled || !files.length) return;
    e.preventDefault();
    addFiles(files);
  });
  const composer = $('composer');
  composer.addEventListener('dragover', (e) => {
    if (!enabled) return;
    e.preventDefault();
    composer.classList.add('dropping');
  });
  composer.addEventListener('dragleave', () => composer.classList.remove('dropping'));
  composer.addEventListener('drop', (e) => {
    composer.classList.remove('dropping');
    if (!enabled || !e.dataTransfer || !e.dataTransfer.files.length) return;
    e.preventDefault();
    addFiles([...e.dataTransfer.files]);
  });
}
