-- Several questions about each document: nested prefixes (system prompt > document > question).
SELECT id, messages FROM document_questions
