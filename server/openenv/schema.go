package openenv

// obj is a JSON Schema object.
type obj = map[string]any

func str(desc string) obj     { return obj{"type": "string", "description": desc} }
func boolean(desc string) obj { return obj{"type": "boolean", "description": desc} }
func num(desc string) obj     { return obj{"type": "number", "description": desc} }
func integer(desc string) obj {
	return obj{"type": "integer", "description": desc}
}

var writeFileSchema = obj{"type": "object", "title": "WriteFile", "additionalProperties": false, "required": []string{"path", "content"},
	"properties": obj{
		"path":    str("the file's path in the sandbox (relative to the env's workdir)"),
		"content": str("the text to write"),
		"append":  boolean("append to the file instead of replacing it"),
		"mode":    integer("permission bits of a created file (decimal; 420 is 0644, the default)"),
	}}

var readFileSchema = obj{"type": "object", "title": "ReadFile", "additionalProperties": false, "required": []string{"path"},
	"properties": obj{
		"path":      str("the file's path in the sandbox (relative to the env's workdir)"),
		"offset":    integer("where to start reading, in bytes"),
		"max_bytes": integer("how much to read at most (0: the env's output cap)"),
	}}

// actionSchema is the action's schema. Its title is not "Action": verifiers' openenv taskset
// takes that title for an MCP env. command is the one required field, so a plain-text reply is
// a command.
var actionSchema = obj{
	"title": "DeltagymAction", "type": "object", "additionalProperties": false, "required": []string{"command"},
	"description": "One step. command is a shell command (\"submit\" submits); it may be empty only when exactly one of write_file, read_file, submit, checkpoint, restore and evaluate is set. checkpoint and restore also go with a command, write or read: the checkpoint is taken after it, the restore done before it.",
	"properties": obj{
		"command":       str("a shell command, run by /bin/sh -c (in the persistent bash named by session when set); \"submit\" submits"),
		"write_file":    writeFileSchema,
		"read_file":     obj{"anyOf": []obj{str("the file's path"), readFileSchema}},
		"submit":        obj{"anyOf": []obj{{"type": "boolean"}, {"type": "string"}}, "description": "true, or the answer: runs the env's verifier and ends the episode"},
		"checkpoint":    boolean("take a checkpoint after the step; its ID is in observation.checkpoint_id"),
		"restore":       str("a checkpoint ID to restore before the step (a new episode starts there)"),
		"fresh_entropy": boolean("with restore: give the restored state a new seed"),
		"evaluate":      boolean("run the env's verifier on the current state without ending the episode; the reward is in reward and observation.evaluation"),
		"timeout":       num("the command's timeout in seconds; more than the server's step cap (55 s by default) is the cap"),
		"cwd":           str("the command's working directory"),
		"env":           obj{"type": "object", "additionalProperties": obj{"type": "string"}, "description": "environment variables of the command"},
		"session":       str("run the command in this persistent shell (cd and exports persist)"),
		"metadata":      obj{"type": "object", "description": "ignored"},
	},
}

var metadataSchema = obj{"type": "object", "title": "DeltagymMetadata", "properties": obj{
	"env":                 str("the env"),
	"sandbox_id":          str("the sandbox of the session"),
	"episode_id":          str("the episode the observation belongs to"),
	"checkpoint_id":       str("the checkpoint this message took or started from"),
	"start_checkpoint_id": str("the checkpoint the episode started from"),
	"step_index":          integer("the step's index on the episode's path; -1 for a reset, restore, checkpoint or evaluation"),
	"step_count":          integer("the steps on the episode's path so far"),
	"terminated":          boolean("the episode ended by a submit"),
	"truncated":           boolean("the episode ended by a budget (truncated_by says which)"),
	"truncated_by":        str("max_steps or max_seconds"),
	"info":                obj{"type": "object", "additionalProperties": obj{"type": "string"}},
}}

var verdictSchema = obj{"type": "object", "properties": obj{
	"reward": num("the verifier's reward"), "components": obj{"type": "object", "additionalProperties": obj{"type": "number"}},
	"output": str("the verifier's output"),
}}

var observationSchema = obj{"title": "DeltagymObservation", "type": "object", "properties": obj{
	"task":             str("the env's task (at a reset)"),
	"stdout":           str("the command's standard output (text)"),
	"stderr":           str("the command's standard error (text)"),
	"exit_code":        integer("the command's exit status; -1 when a signal ended it"),
	"signal":           str("the signal that ended the command"),
	"timed_out":        boolean("the command ran past its timeout and was killed"),
	"output_truncated": boolean("the output was cut at the env's output cap"),
	"duration_s":       num("how long the command ran"),
	"content":          str("what read_file read"),
	"size":             integer("the file's size"),
	"truncated":        boolean("the file goes on past content"),
	"verdict":          verdictSchema,
	"evaluation":       verdictSchema,
	"error":            str("why the sandbox refused the action (the episode goes on)"),
	"errno":            str("that refusal's errno"),
	"checkpoint_id":    str("the checkpoint the action took"),
	"restored_to":      str("the checkpoint the action restored"),
	"metadata":         metadataSchema,
}}

var stateSchema = obj{"title": "DeltagymState", "type": "object", "properties": obj{
	"episode_id": str("the session's episode"), "step_count": integer("the steps on its path"),
	"sandbox_id": str("the session's sandbox"), "env": str("the env"), "done": boolean("the episode has ended"),
	"start_checkpoint_id": str("the checkpoint the episode started from"),
}}

// schemas is the answer of /schema.
var schemas = obj{"action": actionSchema, "observation": observationSchema, "state": stateSchema, "reset_observation": observationSchema}

// tool is an MCP tool.
type tool struct {
	Name        string `json:"name"`
	Description string `json:"description"`
	InputSchema obj    `json:"inputSchema"`
}

func args(required []string, props obj) obj {
	if required == nil {
		required = []string{}
	}
	return obj{"type": "object", "required": required, "properties": props, "additionalProperties": false}
}

// tools are the actions as MCP tools.
var tools = []tool{
	{"bash", "Run a shell command in the sandbox (/bin/sh -c, or the persistent bash named by session); returns its output.", args([]string{"command"}, obj{
		"command": str("the command"), "timeout": num("seconds, at most 55"), "cwd": str("working directory"),
		"env":     obj{"type": "object", "additionalProperties": obj{"type": "string"}},
		"session": str("a persistent shell to run it in")})},
	{"write_file", "Write text to a file in the sandbox.", writeFileSchema},
	{"read_file", "Read a file of the sandbox.", readFileSchema},
	{"submit", "Submit: run the env's verifier and end the episode.", args(nil, obj{"answer": str("the answer, when the env takes one")})},
	{"checkpoint", "Checkpoint the sandbox; returns the checkpoint's ID.", args(nil, obj{})},
	{"restore", "Restore the sandbox to a checkpoint; a new episode starts there.", args([]string{"checkpoint_id"}, obj{
		"checkpoint_id": str("the checkpoint"), "fresh_entropy": boolean("give the restored state a new seed")})},
	{"evaluate", "Run the env's verifier on the current state without ending the episode.", args(nil, obj{})},
}
