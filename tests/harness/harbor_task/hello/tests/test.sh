#!/bin/bash
mkdir -p /logs/verifier
if [ "$(pwd)" = /app ] && [ "$(cat /app/answer.txt)" = "42" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
