package swerex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// The wire shapes of swe-rex 1.4.0 (swerex/runtime/abstract.py): the JSON its RemoteRuntime
// sends and the JSON it reads back into its pydantic models. Fields the client may leave out
// are pointers or carry their default; unknown fields are ignored, as pydantic does.

type isAliveResponse struct {
	IsAlive bool   `json:"is_alive"`
	Message string `json:"message"`
}

type createSessionRequest struct {
	StartupSource  []string `json:"startup_source"`
	Session        *string  `json:"session"`
	SessionType    *string  `json:"session_type"`
	StartupTimeout *float64 `json:"startup_timeout"`
}

type createSessionResponse struct {
	Output      string `json:"output"`
	SessionType string `json:"session_type"`
}

// action is a BashAction or a BashInterruptAction (action_type tells them apart).
type action struct {
	Command              *string  `json:"command"`
	Session              *string  `json:"session"`
	Timeout              *float64 `json:"timeout"`
	IsInteractiveCommand bool     `json:"is_interactive_command"`
	IsInteractiveQuit    bool     `json:"is_interactive_quit"`
	Check                *string  `json:"check"`
	ErrorMsg             string   `json:"error_msg"`
	Expect               []string `json:"expect"`
	ActionType           *string  `json:"action_type"`
	NRetry               *int     `json:"n_retry"`
}

type observation struct {
	Output        string `json:"output"`
	ExitCode      *int   `json:"exit_code"`
	FailureReason string `json:"failure_reason"`
	ExpectString  string `json:"expect_string"`
	SessionType   string `json:"session_type"`
}

type closeSessionRequest struct {
	Session     *string `json:"session"`
	SessionType *string `json:"session_type"`
}

type closeSessionResponse struct {
	SessionType string `json:"session_type"`
}

// command is a Command: Command is a string or a list of strings.
type command struct {
	Command            json.RawMessage   `json:"command"`
	Timeout            *float64          `json:"timeout"`
	Shell              bool              `json:"shell"`
	Check              bool              `json:"check"`
	ErrorMsg           string            `json:"error_msg"`
	Env                map[string]string `json:"env"`
	Cwd                *string           `json:"cwd"`
	MergeOutputStreams bool              `json:"merge_output_streams"`
}

type commandResponse struct {
	Stdout   string `json:"stdout"`
	Stderr   string `json:"stderr"`
	ExitCode *int   `json:"exit_code"`
}

type readFileRequest struct {
	Path     *string `json:"path"`
	Encoding *string `json:"encoding"`
	Errors   *string `json:"errors"`
}

// ReadFileResponse, {"content": …}, is fileContent (files.go), written as it is encoded.

type writeFileRequest struct {
	Content *string `json:"content"`
	Path    *string `json:"path"`
}

// empty is WriteFileResponse, UploadResponse and CloseResponse.
type empty struct{}

// exceptionTransfer is _ExceptionTransfer, the body of an error under the key "swerexception"
// with status 511: the client raises class_path(message), or SwerexException(message) when
// it cannot make that class.
type exceptionTransfer struct {
	Message   string         `json:"message"`
	ClassPath string         `json:"class_path"`
	Traceback string         `json:"traceback"`
	ExtraInfo map[string]any `json:"extra_info"`
}

// statusException is the status of a SWE-ReX error answer.
const statusException = 511

// The exception classes the client raises. swerex.exceptions is always importable where its
// client runs; builtins are Python's.
const (
	excSwerex          = "swerex.exceptions.SwerexException"
	excTimeout         = "swerex.exceptions.CommandTimeoutError"
	excNonZero         = "swerex.exceptions.NonZeroExitCodeError"
	excNoExitCode      = "swerex.exceptions.NoExitCodeError"
	excSyntax          = "swerex.exceptions.BashIncorrectSyntaxError"
	excSessionExists   = "swerex.exceptions.SessionExistsError"
	excSessionNotFound = "swerex.exceptions.SessionDoesNotExistError"
	excValue           = "builtins.ValueError"
	excPermission      = "builtins.PermissionError"
)

// exception is an error answered in SWE-ReX's form: class is the Python class the client
// raises, extra its extra_info.
type exception struct {
	class string
	msg   string
	extra map[string]any
}

func (e *exception) Error() string { return e.msg }

// raise returns an exception of class with a formatted message.
func raise(class, format string, args ...any) *exception {
	return &exception{class: class, msg: fmt.Sprintf(format, args...)}
}

// invalid is a ValueError: the request is wrong, and nothing was done.
func invalid(format string, args ...any) *exception { return raise(excValue, format, args...) }

// classCodes name the error classes in extra_info's "code", as the Connect API's codes do.
var classCodes = map[error]string{
	errdefs.ErrInvalidArgument:    "invalid_argument",
	errdefs.ErrNotFound:           "not_found",
	errdefs.ErrAlreadyExists:      "already_exists",
	errdefs.ErrFailedPrecondition: "failed_precondition",
	errdefs.ErrResourceExhausted:  "resource_exhausted",
	errdefs.ErrAborted:            "aborted",
	errdefs.ErrUnavailable:        "unavailable",
	errdefs.ErrUnauthenticated:    "unauthenticated",
	errdefs.ErrInternal:           "internal",
}

// WriteException answers with SWE-ReX's error form: status 511 and the exception class_path
// with msg (the auth gate's refusal uses it with builtins.PermissionError).
func WriteException(w http.ResponseWriter, classPath, msg string, extra map[string]any) {
	if extra == nil {
		extra = map[string]any{}
	}
	body, _ := json.Marshal(map[string]exceptionTransfer{"swerexception": {Message: msg, ClassPath: classPath, ExtraInfo: extra}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(statusException)
	_, _ = w.Write(body)
}

// Unauthenticated is the class of the answer to a request without the server's token.
const Unauthenticated = excPermission

// Unavailable is the class of the answer to a request whose sandbox's node did not answer the
// node that passed the request on.
const Unavailable = excSwerex

// writeError answers err in SWE-ReX's form: an *exception as it is; an error of the episode
// core or the server by its class (invalid argument: ValueError; the rest SwerexException with
// the class's code in extra_info), an internal one without detail (logged).
func (h *Handler) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var ex *exception
	if errors.As(err, &ex) {
		WriteException(w, ex.class, ex.msg, ex.extra)
		return
	}
	if r.Context().Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		// The client went away (or its deadline passed) during the call: not the server's
		// fault, and no one reads the answer.
		h.log.Debug("call ended by its client", "path", r.URL.Path, "err", err)
		code := "canceled"
		if errors.Is(err, context.DeadlineExceeded) {
			code = "deadline_exceeded"
		}
		WriteException(w, excSwerex, h.cfg.Message(err), map[string]any{"code": code})
		return
	}
	class := errdefs.Class(err)
	code, ok := classCodes[class]
	if !ok || h.cfg.Internal(err) {
		h.log.Error("internal error", "path", r.URL.Path, "err", err)
		WriteException(w, excSwerex, "internal error (details in the server log)", map[string]any{"code": "internal"})
		return
	}
	exc := excSwerex
	switch class {
	case errdefs.ErrInvalidArgument:
		exc = excValue
	case errdefs.ErrUnauthenticated:
		exc = excPermission
	}
	WriteException(w, exc, h.cfg.Message(err), map[string]any{"code": code})
}

// tooLarge reports whether err is a body's read over the request cap (the server's own cap,
// capBodies, or the handler's).
func tooLarge(err error) bool {
	var tooBig *http.MaxBytesError
	var ce *connect.Error
	return errors.As(err, &tooBig) || errors.As(err, &ce) && ce.Code() == connect.CodeResourceExhausted
}

// tooLarge is the answer to a body over the request cap.
func (h *Handler) tooLarge() *exception {
	return invalid("the request body is over the server's request cap of %d bytes (--max-request-bytes): nothing was done; "+
		"write a large file in parts, or upload a directory in several zips", h.cfg.MaxBody)
}

// writeJSON answers v with status 200.
func writeJSON(w http.ResponseWriter, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		WriteException(w, excSwerex, "encoding the answer: "+err.Error(), nil)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// decode reads r's JSON body, the request of endpoint, into v.
func (h *Handler) decode(r *http.Request, endpoint string, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, h.cfg.MaxBody))
	if err := dec.Decode(v); err != nil {
		if tooLarge(err) {
			return h.tooLarge()
		}
		return invalid("the request body is not the JSON object /%s takes: %v", endpoint, err)
	}
	if dec.More() {
		return invalid("the request body holds more than one JSON value")
	}
	return nil
}
