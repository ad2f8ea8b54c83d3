-- The demo batch: every prompt of the three sample tables, plain and chat rows together.
SELECT id, prompt, NULL AS messages, max_tokens FROM review_labels
UNION ALL
SELECT id, NULL AS prompt, messages, NULL AS max_tokens FROM document_questions
UNION ALL
SELECT id, NULL AS prompt, messages, NULL AS max_tokens FROM support_replies
