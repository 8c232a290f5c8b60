// Package swerex serves SWE-ReX's HTTP API (swe-rex 1.4.0's RemoteRuntime) for the sandboxes of
// the episode core: /swerex/{sandbox_id}/{is_alive, create_session, run_in_session,
// close_session, execute, read_file, write_file, upload, close}.
//
// Every command and file action is a Step of the sandbox's episode (episode.Core.Step), so it
// is counted against the env's budgets and recorded in the ledger with its output. A SWE-ReX
// session is a persistent shell of the sandbox (episode.Exec.Session, named "swerex." and the
// session's name); its interactive commands (is_interactive_command, is_interactive_quit,
// expect strings, bash_interrupt) run as sandbox.Interact, which reads and answers them as
// pexpect does SWE-ReX's own shell: a program reads the session's input, the answer ends at the
// earliest match of an expect pattern or at the program's end (SWE-ReX's PS1), and an
// interrupt is SIGINT to what the session runs. Unlike SWE-ReX's pty, the program's input and
// output are pipes: a program that prompts only on a terminal (python3 without -i) does not.
//
// Errors answer with status 511 and {"swerexception": {message, class_path, traceback,
// extra_info}}, which the client raises as class_path(message): SWE-ReX's own exceptions
// (CommandTimeoutError, NonZeroExitCodeError, SessionExistsError, …), Python's OSErrors for a
// file or program the sandbox's state refused, ValueError for a request that is wrong (nothing
// is done), SwerexException with extra_info["code"] for the episode core's other errors.
package swerex
