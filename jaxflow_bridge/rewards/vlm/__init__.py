"""The rewards a served vision-language model scores over its OpenAI-compatible HTTP API (OCR, judge, edit judge)."""
