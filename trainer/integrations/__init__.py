"""trainerd for jobs written against a training framework's own runner rather than a script of the user's."""
