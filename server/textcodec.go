package server

import (
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/deltagym/deltagym/internal/wiretext"
)

// Text a sandbox controls — a file's name, a process's name, a command line, a message that
// quotes one — may hold bytes that are not UTF-8, which a protobuf string field cannot: a
// message holding them fails to marshal, and the call with it. The server's codecs send such a
// message with each of those bytes replaced by U+FFFD (wiretext's rule) instead: a response
// never fails for the text a sandbox chose, in any protocol or encoding. The valid message, by
// far the most common, marshals once, as connect's own codecs do; only one that failed is
// copied, made valid and marshalled again.

// protoCodec is connect's binary codec, but for a response holding text that is not UTF-8.
type protoCodec struct{}

// codecs replace connect's binary codec and its JSON ones (jsonCodec).
func codecs() []connect.HandlerOption {
	return append(jsonCodecs(), connect.WithCodec(protoCodec{}))
}

func (protoCodec) Name() string { return "proto" }

func (protoCodec) IsBinary() bool { return true }

func (protoCodec) Marshal(m any) ([]byte, error) {
	return marshalValid(m, func(pm proto.Message) ([]byte, error) { return proto.Marshal(pm) })
}

func (protoCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	return marshalValid(m, func(pm proto.Message) ([]byte, error) { return proto.MarshalOptions{}.MarshalAppend(dst, pm) })
}

func (protoCodec) MarshalStable(m any) ([]byte, error) {
	return marshalValid(m, func(pm proto.Message) ([]byte, error) { return proto.MarshalOptions{Deterministic: true}.Marshal(pm) })
}

func (protoCodec) Unmarshal(b []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	if err := proto.Unmarshal(b, pm); err != nil {
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return nil
}

// marshalValid marshals m with marshal; if that fails, it marshals a copy of m with its
// strings made valid (wiretext.Message) instead. The copy leaves m as it was: a response may be
// kept (an idempotent call's answer) and sent again. An error not of text is marshal's own.
func marshalValid(m any, marshal func(proto.Message) ([]byte, error)) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	b, err := marshal(pm)
	if err == nil {
		return b, nil
	}
	valid := proto.Clone(pm)
	if !wiretext.Message(valid) {
		return nil, err
	}
	return marshal(valid)
}
