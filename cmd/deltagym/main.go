// Command deltagym runs the deltagym server (`deltagym serve`) and talks to a
// running one: reset sandboxes, run commands in them, checkpoint, restore,
// fork, evaluate, submit and close them, and read the trajectory ledger.
//
// Every client subcommand takes --addr (default $DELTAGYM_ADDR or
// 127.0.0.1:8080; a cluster target, dns:NAME:PORT or a comma-separated list,
// routes each command to the node that holds its sandbox or checkpoint, and
// reset to the least loaded: conn.go), --token (default $DELTAGYM_TOKEN, else the file
// $DELTAGYM_TOKEN_FILE, else the server's token file, .data/token or
// $DELTAGYM_DATA/token) and --json (print the
// response as protojson, one object per line). Exit status: 0 on success, 1
// on an error (its Connect code and message on stderr), 2 on a usage error;
// exec exits with its command's status (128+N for signal N, 124 on timeout).
// `deltagym help` lists the subcommands, `deltagym help COMMAND` describes one, and
// `deltagym completion bash|zsh|fish` prints a script that completes them in the shell.
//
// The grammar is declared as structs (cli.go: one per command, its fields its arguments and
// flags) and parsed by kong; serve hands its arguments to the server's own flag set.
package main

import (
	"context"
	"os"
)

func main() {
	os.Exit(Main(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
