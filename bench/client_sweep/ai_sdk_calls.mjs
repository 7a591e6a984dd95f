// The AI SDK's first calls (npm `ai` + `@ai-sdk/openai`) against the sweep's server: createOpenAI({ baseURL }) and
// its default model, openai(id) (the Responses API), with generateText, streamText, a tool the model should call (the
// SDK runs it and continues, stopWhen stepCountIs(5)), a zod-typed object (generateText with output: Output.object,
// which replaced generateObject), streamed (streamText with the same output), the same text on the Chat Completions
// model (openai.chat(id)), and embedMany.
// streamText does not throw on a failed stream: its errors are collected with onError and thrown after it.
// maxRetries 0: nothing is retried. Run by bench/client_sweep.py (see _common.mjs).

import { createOpenAI } from "@ai-sdk/openai";
import { Output, embedMany, generateText, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";
import { KEY, MODEL, ModelSide, URL, WEATHER_PROMPT, main } from "./_common.mjs";

const openai = createOpenAI({ baseURL: URL, apiKey: KEY });
const model = openai(MODEL);
const Person = z.object({ name: z.string(), age: z.number().int() });

async function text() {
  const r = await generateText({ model, prompt: "Say hello in one sentence.", maxRetries: 0 });
  return `${r.finishReason}: ${r.text}`;
}

async function stream() {
  const errors = [];
  const r = streamText({ model, prompt: "Count from 1 to 5.", maxRetries: 0, onError: ({ error }) => errors.push(error) });
  let out = "";
  for await (const piece of r.textStream) out += piece;
  if (errors.length) throw errors[0];
  return `${await r.finishReason}: ${out}`;
}

async function tools() {
  const called = [];
  const r = await generateText({
    model,
    prompt: WEATHER_PROMPT,
    maxRetries: 0,
    stopWhen: stepCountIs(5),
    tools: {
      get_weather: tool({
        description: "Get the current weather in a city.",
        inputSchema: z.object({ city: z.string() }),
        execute: async ({ city }) => {
          called.push(city);
          return `sunny, 22 C in ${city}`;
        },
      }),
    },
  });
  if (!called.length) throw new ModelSide(`no tool call (finishReason ${r.finishReason}): ${JSON.stringify(r.text)}`);
  return `get_weather(${JSON.stringify(called)}) -> ${r.text}`;
}

async function object() {
  const r = await generateText({
    model,
    output: Output.object({ schema: Person }),
    prompt: "Extract the person: John Smith is 42 years old.",
    maxRetries: 0,
  });
  return r.output;
}

async function objectStream() {
  const errors = [];
  const r = streamText({
    model,
    output: Output.object({ schema: Person }),
    prompt: "Extract the person: John Smith is 42 years old.",
    maxRetries: 0,
    onError: ({ error }) => errors.push(error),
  });
  let partials = 0;
  for await (const _ of r.partialOutputStream) partials++;
  if (errors.length) throw errors[0];
  return `${partials} partials: ${JSON.stringify(await r.output)}`;
}

async function chatModel() {
  const r = await generateText({ model: openai.chat(MODEL), prompt: "Say hello in one sentence.", maxRetries: 0 });
  return `${r.finishReason}: ${r.text}`;
}

async function embeddings() {
  const r = await embedMany({ model: openai.embedding(MODEL), values: ["hello world", "goodbye"], maxRetries: 0 });
  return `${r.embeddings.length} vectors of ${r.embeddings[0].length}`;
}

await main("ai-sdk", ["ai", "@ai-sdk/openai", "zod"], [
  ["generateText", text],
  ["streamText", stream],
  ["tools", tools],
  ["output_object", object],
  ["output_object_stream", objectStream],
  ["chat_model", chatModel],
  ["embedMany", embeddings],
]);
