"""The wire APIs clients call, each a thin translation over the one request path (``runtime/serving.py``), with
their schemas: OpenAI's Chat Completions (``chat``), Responses (``responses``, its items ``responses_schemas`` and
stored responses ``response_store`` / ``response_store_pg``), legacy Completions (``completions``,
``completions_logprobs``), Embeddings (``embeddings``), the model list (``models``), Anthropic's Messages
(``messages``), and the OpenAI request schemas they share (``openai_schemas``).

Each module holds a module-level ``router`` that ``runtime/app.py`` includes; handlers read the app's parts with
``runtime.services.services(request)`` and take their validated body from ``runtime.http_body.json_body``.

Not here: generation, routing, recording (``runtime/serving.py``, ``runtime/generation.py``), the admin API and the
loop's own ``/v1`` routes (``runtime/admin/``).
"""
