"""What every long compute call runs inside: cancel / fault points and the Celery app."""
