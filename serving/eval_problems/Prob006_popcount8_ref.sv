module RefModule (
  input  [7:0] in,
  output [3:0] out
);

  assign out = {3'b000, in[0]} + {3'b000, in[1]} + {3'b000, in[2]} + {3'b000, in[3]}
             + {3'b000, in[4]} + {3'b000, in[5]} + {3'b000, in[6]} + {3'b000, in[7]};

endmodule
