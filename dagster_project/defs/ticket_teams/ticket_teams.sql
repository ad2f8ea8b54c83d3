-- Support tickets joined to their customers: the prompt is built from the join's fields (see defs.yaml).
SELECT t.id, c.name AS customer, c.profile, c.plan, c.region, t.subject AS ticket, t.priority
FROM support_tickets t JOIN customers c USING (customer_id)
