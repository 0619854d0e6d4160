// check.mjs — rekv's HTTP server as the official `openai` npm client sees it (run by
// tests/test_http_openai.c against a real coordinator and worker). Each check asserts what the
// client returns; the last line printed is a JSON summary the C test compares with the control
// socket's own record of the same jobs.
//
// Environment: REKV_BASE_URL (http://127.0.0.1:PORT/v1), REKV_MODEL, REKV_API_KEY; REKV_CHAT_BASE_URL
// and REKV_CHAT_MODEL: a server whose model has a chat template (no API key).
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const client = new OpenAI({
  baseURL: process.env.REKV_BASE_URL,
  apiKey: process.env.REKV_API_KEY,
  maxRetries: 0,
});
const model = process.env.REKV_MODEL;
const summary = {};
const prompt = 'The package provides';

async function check(name, fn) {
  await fn();
  console.log(`ok ${name}`);
}

await check('models.list', async () => {
  const page = await client.models.list();
  const ids = page.data.map((m) => m.id);
  assert.deepEqual(ids, [model]);
});

await check('completions', async () => {
  const c = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0 });
  assert.equal(c.object, 'text_completion');
  assert.equal(c.choices.length, 1);
  assert.equal(c.choices[0].finish_reason, 'length');
  assert.equal(c.usage.completion_tokens, 16);
  assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + 16);
  summary.completion_id = c.id;
  summary.completion_text = c.choices[0].text;
});

await check('completions stream', async () => {
  const stream = await client.completions.create({
    model, prompt, max_tokens: 16, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.text;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(text, summary.completion_text);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 16);
});

await check('completions n and seed', async () => {
  const c = await client.completions.create({
    model, prompt: ['Debian', 'apt'], max_tokens: 4, temperature: 1, seed: 3, n: 2,
  });
  assert.deepEqual(c.choices.map((x) => x.index), [0, 1, 2, 3]);
  const again = await client.completions.create({
    model, prompt: 'apt', max_tokens: 4, temperature: 1, seed: 4,
  });
  assert.equal(again.choices[0].text, c.choices[3].text);
});

await check('errors', async () => {
  await assert.rejects(
    client.completions.create({ model: 'no-such-model', prompt, max_tokens: 2 }),
    (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 0 }),
    (e) => e instanceof OpenAI.BadRequestError && e.type === 'invalid_request_error');
  await assert.rejects(
    client.completions.create({ model, prompt: 'x'.repeat(700), max_tokens: 2 }),
    (e) => e instanceof OpenAI.BadRequestError && /context/.test(e.message));
  const bad = new OpenAI({ baseURL: process.env.REKV_BASE_URL, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
});

await check('chat without a template', async () => {
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }] }),
    (e) => e instanceof OpenAI.BadRequestError && /chat template/.test(e.message));
});

await check('stop strings', async () => {
  const full = (await client.completions.create({ model, prompt, max_tokens: 40, temperature: 0 }))
    .choices[0].text;
  const stop = full.slice(12, 15);
  const want = full.slice(0, full.indexOf(stop));
  const c = await client.completions.create({ model, prompt, max_tokens: 40, temperature: 0, stop });
  assert.equal(c.choices[0].text, want);
  assert.equal(c.choices[0].finish_reason, 'stop');
  const stream = await client.completions.create({
    model, prompt, max_tokens: 40, temperature: 0, stop: [stop], stream: true,
  });
  let text = '';
  for await (const chunk of stream) for (const ch of chunk.choices) text += ch.text;
  assert.equal(text, want);
});

await check('completion logprobs', async () => {
  const c = await client.completions.create({
    model, prompt, max_tokens: 6, temperature: 0, logprobs: 2,
  });
  const lp = c.choices[0].logprobs;
  assert.equal(lp.tokens.length, 6);
  assert.equal(lp.tokens.join(''), c.choices[0].text);
  for (let i = 0; i < 6; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    assert.equal(Math.max(...Object.values(lp.top_logprobs[i])), lp.token_logprobs[i]);
  }
});

const chat = new OpenAI({ baseURL: process.env.REKV_CHAT_BASE_URL, apiKey: 'none', maxRetries: 0 });
const chatModel = process.env.REKV_CHAT_MODEL;
const messages = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: [{ type: 'text', text: 'Name a colour.' }] },
];

await check('chat', async () => {
  const c = await chat.chat.completions.create({
    model: chatModel, messages, max_completion_tokens: 10, temperature: 0,
    logprobs: true, top_logprobs: 2,
  });
  assert.equal(c.object, 'chat.completion');
  const m = c.choices[0].message;
  assert.equal(m.role, 'assistant');
  assert.equal(c.choices[0].logprobs.content.length, c.usage.completion_tokens);
  assert.equal(c.choices[0].logprobs.content[0].top_logprobs.length, 2);
  summary.chat_id = c.id;
  summary.chat_text = m.content;
  const stream = await chat.chat.completions.create({
    model: chatModel, messages, max_tokens: 10, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let role = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      if (ch.delta.role) role = ch.delta.role;
      text += ch.delta.content ?? '';
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(text, m.content);
  assert.equal(usage.completion_tokens, c.usage.completion_tokens);
  await assert.rejects(
    chat.chat.completions.create({ model: chatModel, messages: [] }),
    (e) => e instanceof OpenAI.BadRequestError);
});

await check('stream aborted', async () => {
  const ac = new AbortController();
  const stream = await client.completions.create(
    { model, prompt, max_tokens: 400, temperature: 0, stream: true },
    { signal: ac.signal });
  for await (const chunk of stream) {
    summary.aborted_id = chunk.id;
    ac.abort();
    break;
  }
});

console.log(JSON.stringify(summary));
