-- Structured facts from the same reviews, answered as JSON objects (see response_format in defs.yaml).
-- One instruction shared by every row; the review is cut out of the labelling prompt with a regex.
SELECT 'facts-' || id AS id,
       'Extract facts from the customer review as a JSON object with the fields "product" (the product '
       || 'named), "sentiment" (positive, negative or neutral) and "defect" (true when the review reports '
       || 'something broken, damaged or late).' || chr(10) || chr(10)
       || 'Review: ' || regexp_extract(prompt, 'Review: ([^\n]*)\nLabel:$', 1) || chr(10) || 'JSON:' AS prompt
FROM review_labels
WHERE id < 'review-0060'
