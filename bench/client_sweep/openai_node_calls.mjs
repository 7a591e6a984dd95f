// The openai Node SDK's first calls against the sweep's server: chat, a streamed chat, a function tool round trip,
// chat.completions.parse with a zod schema (zodResponseFormat), the Responses API (plain and streamed) and embeddings.
// Run by bench/client_sweep.py (see _common.mjs); maxRetries 0: nothing is retried.

import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { z } from "zod";
import { KEY, MODEL, ModelSide, URL, WEATHER_PROMPT, main } from "./_common.mjs";

const client = new OpenAI({ baseURL: URL, apiKey: KEY, maxRetries: 0 });
const TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city.",
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
    },
  },
];
const Person = z.object({ name: z.string(), age: z.number().int() });

async function chat() {
  const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "Say hello in one sentence." }] });
  return r.choices[0].message.content;
}

async function chatStream() {
  const stream = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "Count from 1 to 5." }], stream: true });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  return text;
}

async function tools() {
  const messages = [{ role: "user", content: WEATHER_PROMPT }];
  const r = await client.chat.completions.create({ model: MODEL, messages, tools: TOOLS });
  const msg = r.choices[0].message;
  if (!msg.tool_calls?.length) throw new ModelSide(`no tool call (finish_reason ${r.choices[0].finish_reason}): ${JSON.stringify(msg.content)}`);
  const call = msg.tool_calls[0];
  const args = JSON.parse(call.function.arguments);
  messages.push(msg, { role: "tool", tool_call_id: call.id, content: "sunny, 22 C" });
  const r2 = await client.chat.completions.create({ model: MODEL, messages, tools: TOOLS });
  return `${call.function.name}(${JSON.stringify(args)}) -> ${JSON.stringify(r2.choices[0].message.content)}`;
}

async function structured() {
  const r = await client.chat.completions.parse({
    model: MODEL,
    messages: [{ role: "user", content: "Extract the person: John Smith is 42 years old." }],
    response_format: zodResponseFormat(Person, "person"),
  });
  const parsed = r.choices[0].message.parsed;
  if (parsed == null) throw new ModelSide(`no parsed object: ${JSON.stringify(r.choices[0].message.content)}`);
  return parsed;
}

async function responses() {
  return (await client.responses.create({ model: MODEL, input: "Say hello in one sentence." })).output_text;
}

async function responsesStream() {
  const stream = client.responses.stream({ model: MODEL, input: "Count from 1 to 5." });
  let text = "";
  for await (const event of stream) if (event.type === "response.output_text.delta") text += event.delta;
  const final = await stream.finalResponse();
  return `${final.status}: ${text}`;
}

async function embeddings() {
  const e = await client.embeddings.create({ model: MODEL, input: ["hello world", "goodbye"] });
  return `${e.data.length} vectors of ${e.data[0].embedding.length}`;
}

await main("openai-node", ["openai", "zod"], [
  ["chat", chat],
  ["chat_stream", chatStream],
  ["tools", tools],
  ["structured", structured],
  ["responses", responses],
  ["responses_stream", responsesStream],
  ["embeddings", embeddings],
]);
