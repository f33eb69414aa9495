"""Each API body's prompt and the one typed engine request it becomes: every body (OpenAI
chat and completions, Anthropic Messages, Responses, llama-server's /completion and
/infill; Vertex AI's predict dispatches to those) becomes a ``service.submit.Submission``
(``submissions``), whose ``PromptSource`` (``sources``) turns it into tokens: the chat
pipeline (``chat``: messages, tools and reasoning plan, template rendering, constraint),
the completion prompts (``completion``, with llama-server's prompt forms in
``completion_forms``) and fill-in-the-middle (``infill_prompt``). It sits between
``server.service`` and ``server.protocols``: routes parse bodies and shape answers, nothing
else."""
