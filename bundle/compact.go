package bundle

import (
	"encoding/json"
	"unicode/utf8"
)

// parseCompact decodes the compact form of a header that this package,
// the Python client and safetensors itself write (no whitespace; each
// tensor's keys in the order dtype, shape, data_offsets; names without
// escapes; plain non-negative integers) at a small fraction of
// encoding/json's cost, which for a model of many thousand tensors stood
// between its first publish and its readers. ok is false
// for anything else, which parseJSON decodes; a header it accepts decodes
// to what parseJSON makes of it (FuzzParse checks).
func parseCompact(h []byte) (m *Manifest, ok bool, err error) {
	p := compact{b: h}
	if !p.byte('{') {
		return nil, false, nil
	}
	m = &Manifest{}
	seen := make(map[string]struct{}, len(h)/80)
	metadata := false
	for first := true; ; first = false {
		if p.byte('}') {
			if first || p.i == len(h) {
				return m, p.i == len(h), nil
			}
			return nil, false, nil
		}
		if !first && !p.byte(',') {
			return nil, false, nil
		}
		name, ok := p.str()
		if !ok || !p.byte(':') {
			return nil, false, nil
		}
		if name == "__metadata__" {
			end, ok := p.skipObject()
			if !ok || metadata {
				return nil, false, nil
			}
			metadata = true
			if err := json.Unmarshal(h[p.i:end], &m.Metadata); err != nil {
				return nil, false, nil
			}
			p.i = end
			continue
		}
		if _, dup := seen[name]; dup {
			return nil, false, nil
		}
		seen[name] = struct{}{}
		t := Tensor{Name: name, Shape: []int64{}}
		if !p.lit(`{"dtype":`) {
			return nil, false, nil
		}
		d, ok := p.str()
		if !ok || !p.lit(`,"shape":[`) {
			return nil, false, nil
		}
		t.DType = DType(d)
		for k := 0; !p.byte(']'); k++ {
			if k > 0 && !p.byte(',') {
				return nil, false, nil
			}
			n, ok := p.int()
			if !ok {
				return nil, false, nil
			}
			t.Shape = append(t.Shape, n)
		}
		if !p.lit(`,"data_offsets":[`) {
			return nil, false, nil
		}
		var okb, oke bool
		t.Begin, okb = p.int()
		if !okb || !p.byte(',') {
			return nil, false, nil
		}
		t.End, oke = p.int()
		if !oke || !p.lit(`]}`) {
			return nil, false, nil
		}
		if err := t.check(); err != nil {
			return nil, true, err
		}
		m.Tensors = append(m.Tensors, t)
	}
}

type compact struct {
	b []byte
	i int
}

func (p *compact) byte(c byte) bool {
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

func (p *compact) lit(s string) bool {
	if len(p.b)-p.i >= len(s) && string(p.b[p.i:p.i+len(s)]) == s {
		p.i += len(s)
		return true
	}
	return false
}

// str reads a string without escapes or control characters, in UTF-8.
func (p *compact) str() (string, bool) {
	if !p.byte('"') {
		return "", false
	}
	start := p.i
	for p.i < len(p.b) {
		switch c := p.b[p.i]; {
		case c == '"':
			s := string(p.b[start:p.i])
			p.i++
			// encoding/json would replace invalid UTF-8: leave that to it.
			return s, utf8.ValidString(s)
		case c == '\\' || c < 0x20:
			return "", false
		}
		p.i++
	}
	return "", false
}

// int reads a JSON integer of at most 18 digits, without sign or leading
// zero.
func (p *compact) int() (int64, bool) {
	start := p.i
	var n int64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		n = n*10 + int64(p.b[p.i]-'0')
		p.i++
	}
	d := p.i - start
	if d == 0 || d > 18 || (d > 1 && p.b[start] == '0') {
		return 0, false
	}
	return n, true
}

// skipObject finds the end of the JSON object starting at p.i (strings
// may hold braces and escapes), without moving.
func (p *compact) skipObject() (int, bool) {
	if p.i >= len(p.b) || p.b[p.i] != '{' {
		return 0, false
	}
	depth := 0
	for i := p.i; i < len(p.b); i++ {
		switch p.b[i] {
		case '"':
			for i++; i < len(p.b) && p.b[i] != '"'; i++ {
				if p.b[i] == '\\' {
					i++
				}
			}
		case '{':
			depth++
		case '}':
			if depth--; depth == 0 {
				return i + 1, true
			}
		}
	}
	return 0, false
}
