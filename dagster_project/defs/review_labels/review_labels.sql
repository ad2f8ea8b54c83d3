-- Sentiment labels: one instruction + few-shot block shared by every row.
SELECT id, prompt, max_tokens FROM review_labels
