"""The local stack: Redis/PostgreSQL checks, migrations, the three services as processes."""
