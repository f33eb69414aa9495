"""Tool calling and reasoning for chat: request checks (``spec``), tools in the prompt
(``prompt``), and incremental output parsers (``parse``). See README "Tool calling and
reasoning"."""
