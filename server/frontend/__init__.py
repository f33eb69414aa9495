"""The front end: every API body (OpenAI chat and completions, Anthropic Messages,
Responses, llama-server's /completion and /infill; Vertex AI's predict dispatches to
those) becomes one typed engine request, ``service.submit.Submission``
(``requests``), whose ``PromptSource`` (``sources``) turns it into tokens: the chat
pipeline (``chat``: messages, tools and reasoning plan, template rendering, constraint)
and the completion prompts (``completion``). It sits between ``server.service`` and
``server.routes``: routes parse bodies and shape answers, nothing else."""
