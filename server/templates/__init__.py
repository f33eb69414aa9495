"""Chat templates and what they imply: rendering in a sandboxed Jinja2 environment
(``chat_template``), the tool-call and reasoning families a template's own text names
(``families``, ``reasoning_tags``, ``control_tokens``), tools and tool history in the prompt
(``tools_prompt``, ``frames``, ``tool_fields``), the incremental parsers of a model's output
(``output_parse``, ``jsonscan``, ``regions``, ``harmony``), and one chat request's plan for
tools and reasoning (``chat_plan``). See README "Tool calling and reasoning"."""
