#!/bin/bash
set -e
# Long enough for the test watcher to read the sandbox while it lives.
sleep 1
echo $((2 + 40)) > answer.txt
