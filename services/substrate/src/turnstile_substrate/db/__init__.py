"""PostgreSQL: the schema's migrations, the connection pool and the records."""
