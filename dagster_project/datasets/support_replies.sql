-- Support tickets as chat rows sharing a support-agent system prompt.
SELECT id, messages FROM support_replies
