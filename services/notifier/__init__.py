"""The notifier: signed webhooks for task outcomes (callbacks) and failure alerts."""
